"""Catalogs: GPU types, node configurations, models, prices and scenarios, loaded and validated from `data/`."""
