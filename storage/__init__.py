"""Talking to the backing services: settings, the database (models, sessions, row-level lifecycle),
the object store, Parquet codecs, the broker's sending side, and the composition root
(``storage.runtime``). Builds on ``scheduler`` only."""
