"""stofc.tune: the two-stage search on the GPU and the tuning database.

Modules, in the order a tuning run uses them:

* :mod:`~stofc.tune.interfaces`: the contracts (``Config``, ``Scheme``,
  ``Move``, ``Measurement``; protocols ``SegmentSpace``, ``SchemeSpace``,
  ``Measurer``) that the plan and kernel modules implement to plug in.
* :mod:`~stofc.tune.adapters`: ready adapters from declared kernel spaces and
  the plan module's moves to those protocols.
* :mod:`~stofc.tune.device`: the GPU present must be the one asked for.
* :mod:`~stofc.tune.db`: the SQLite tuning database (best records + every sample).
* :mod:`~stofc.tune.evaluate`: memo → database → measurer; nothing measured twice.
* :mod:`~stofc.tune.stage1`: fusion-scheme search (expand / seize / compete).
* :mod:`~stofc.tune.stage2`: parameter search with a shared, shifting budget.
* :mod:`~stofc.tune.measure`: isolated GPU measurement (worker process,
  timeout, fault recovery, CUDA-event timing, machine-wide GPU lock).
* :mod:`~stofc.tune.compile_pool`: candidates compiled in parallel beside it.
* :mod:`~stofc.tune.engine`: ``tune_chain``: both stages for one layer chain.
* :mod:`~stofc.tune.progress`: what the user sees (rich, JSON, quiet).
* :mod:`~stofc.tune.spaces`: the segment spaces of the registered kernel families
  (:mod:`stofc.kernels.catalog`: problem keys, analytical defaults, plan specs).
* :mod:`~stofc.tune.runners` (:mod:`~stofc.tune.runner_segments`,
  :mod:`~stofc.tune.runner_attention`): the GPU runners and the compile-pool
  entry that time and verify real kernels in the worker.
* :mod:`~stofc.tune.plan_tuner`: ``tune_plan``: a plan tuned per length bucket;
  ``tune_stage``: the road's tune stage, a :class:`~stofc.plan.plan.TunedPlan`
  (``stofc.pipeline`` chains it: ``compile --tune`` and ``tune_package``).
* :mod:`~stofc.tune.probe`: ``python -m stofc.tune.probe``, a GPU self-check
  of the measurement machinery.
"""
