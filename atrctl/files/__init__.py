"""Files atrctl writes and reads back: atomic writes, the one checked JSON reader, and destination checks made
before the first byte is written."""
