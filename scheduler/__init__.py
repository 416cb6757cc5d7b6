"""Deciding what runs where and when, and what it cost: pure decisions and arithmetic over frozen
snapshots (ordering, packing, deadlines, leases, cost, SLAs). Imports nothing of Freight's; the
dispatcher in ``workers.dispatcher`` applies the decisions to the database and the broker."""
