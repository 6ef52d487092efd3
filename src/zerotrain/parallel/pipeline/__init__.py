"""Pipeline parallelism: schedules as data, stage modules, and the executor."""
