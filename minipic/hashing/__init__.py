"""SSep/PDep block hashing (engine-core process)."""
