"""bench.py's pieces: ``runs`` starts and times the programs, ``speed`` and ``quality`` make the table's rows,
``products`` measures the machine's matrix multiplies, ``report`` writes the table and the JSON."""
