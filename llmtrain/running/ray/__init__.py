"""Training on Ray Train (``ray_config=``); imported only for a trainer that has one."""
