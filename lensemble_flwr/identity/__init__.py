"""Who takes part: identity keys and signatures, and the coordinator's participant registry."""
