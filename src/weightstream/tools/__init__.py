"""Operator tools, above the library: the storage probe and sweep (``weightstream bench`` and
``tune``), the heat map, the instance recommender (``weightstream recommend``) and the sample
checkpoint writer (``python -m weightstream.tools.sample``). Nothing in the library imports them."""
