"""Packing sources: one module per kind of source (image trees and lists, Parquet and Arrow, WebDataset tars)
behind one registry (``preprocess.pack.sources.registry``)."""
