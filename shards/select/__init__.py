"""Selection over the column index: subsets, ``where`` filters, key lists and mixtures, as vectorised masks and draws."""
