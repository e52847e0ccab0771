"""Lightning callbacks: one file per callback, thin glue over ``lightning_pulse.core``."""
