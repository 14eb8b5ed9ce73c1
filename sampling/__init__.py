"""sample.py's work, apart from its entry point: ``request`` checks what is asked and readies the model, ``writing``
draws the characters (model.sampler's window, compiled where that pays, or the plain path) and writes the samples,
``compiling`` decides when compiling pays (``--compile auto``), ``stops`` ends it on Ctrl-C or SIGTERM in one line."""
