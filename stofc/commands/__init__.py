"""One module per ``stofc`` command; each holds only argument parsing and output."""
