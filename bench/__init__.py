"""The benchmark: the bridge per transport against what a user would otherwise do, same run, same host."""
