"""Model-side building blocks."""
