"""Pipeline parallelism: schedules as data (``schedule``, ``builders``), checked and timed
without processes (``validate``, ``simulate``), and run by an executor.

Import from the modules themselves; this file re-exports nothing, so that the modules of
the package can be written on separate branches and merged without conflicts here.
"""
