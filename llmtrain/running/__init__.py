"""Running a fit: the trainer, its registration, and the executors (in process, launched, Ray)."""
