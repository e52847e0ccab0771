"""Energy meters, carbon-intensity series and reports."""
