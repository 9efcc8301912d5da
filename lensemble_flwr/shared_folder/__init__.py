"""No coordinator process: rounds that meet in a folder every node mounts."""
