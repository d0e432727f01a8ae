"""``python -m stofc`` is the ``stofc`` command."""

from stofc.cli import main

if __name__ == "__main__":
    main()
