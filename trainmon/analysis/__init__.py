"""What the run-time alert sink and the offline commands share: the rules, written once
(``rules``), and the training-flow order of rows (``flow``).  Depends on neither ``diagnosis``,
``sinks`` nor ``runtime``: both sides import it."""
