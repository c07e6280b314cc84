"""Where things are recorded: the metadata store, the artifact store, component classes."""
