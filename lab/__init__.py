"""The attention lab: teaching code that shows what the model does. ``lab.notes`` runs each step of the attention
notes under their names; ``lab.heatmap`` draws attention weights as pictures; ``lab.seq2seq`` and ``lab.sort`` are
the notes' encoder-decoder exercise, sorting digits with attention (``python -m lab sort``). Imports model/ and
configs/, never training/."""
