"""The attention lab: teaching code that shows what the model does. ``lab.notes`` runs each step of the attention
notes under their names; ``lab.heatmap`` draws attention weights as pictures. Imports model/, never training/."""
