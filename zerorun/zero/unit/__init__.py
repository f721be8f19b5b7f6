"""Units: the flat storage of parameters, its layout and per-rank chunks, which parameters form which unit, and one record per unit."""
