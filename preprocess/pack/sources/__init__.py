"""Packing sources: one scanner per kind of source (image trees and lists, Parquet and Arrow, WebDataset tars) behind one registry."""
