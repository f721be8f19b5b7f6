"""The one communication module (timed collectives with an explicit group), the ring, and the process group."""
