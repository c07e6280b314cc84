"""The one schema of a run's configuration: argument models, the data a fit reads, YAML files."""
