"""Tuning: the online depth controller (``controller``, pure) and its adapter to the engine's
:class:`~weightstream.engine.scheduler.Tuner` protocol (``online``)."""
