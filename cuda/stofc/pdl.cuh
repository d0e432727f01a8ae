// stofc: programmatic dependent launch (PDL) on sm_90 and newer.
//
// Contract (read-only for every template that includes it):
//   * A kernel whose ORT op may launch it with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
//     (cuda/ort/OPS.md, "Programmatic dependent launch") calls pdl_wait() in every thread before
//     its first access to global memory that another kernel of the run may write or read:
//     the previous kernel's results and the buffers ORT hands out (an output may reuse memory the
//     previous kernel still reads). Only thread-local setup, shared-memory and mbarrier
//     initialisation and tensor-map prefetches may come before it.
//   * pdl_launch_dependents() lets the next PDL-launched kernel's blocks start (they wait in
//     their own pdl_wait() until this grid has completed and its writes are visible); calling it
//     early only moves the next kernel's launch and prologue earlier.
//   * Both compile to nothing below sm_90 (__CUDA_ARCH__ < 900): the op launches a kernel with
//     PDL only when its PTX was generated for compute_90 or newer (CU_FUNC_ATTRIBUTE_PTX_VERSION
//     >= 90). Without the attribute, griddepcontrol.wait returns at once.
#ifndef STOFC_PDL_CUH
#define STOFC_PDL_CUH

namespace stofc {

/// Waits until the grids this one depends on have completed and their memory is visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/// Lets the dependent grid launch (its blocks then wait in pdl_wait()).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace stofc

#endif  // STOFC_PDL_CUH
