"""Views parse, authorize, call one service, serialize. No SQL, no engine work."""
