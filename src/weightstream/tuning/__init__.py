"""Tuning: the online controller (``controller``), its engine adapter (``online``), instance
profiles and recommendations (``recommend``), static profile files (``profile``)."""
