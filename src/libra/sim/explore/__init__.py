"""The gains map (`libra explore`): sweep a grid of regimes, and per cell measure what each
mechanism of the ablation ladder adds and how far the systems are from the limit."""
