"""`splitspec bench`: side-by-side speed of plain, in-process and remote drafting, and transformers."""
