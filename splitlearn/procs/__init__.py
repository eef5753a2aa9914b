"""What running splitlearn's processes needs: :mod:`.localserver` (servers as child processes on
loopback: the demo, the cluster, the tests, the benchmarks), :mod:`.idlepoll` (``--poll-idle``:
keep a process's cores from sleeping), :mod:`.openmp` (how long idle OpenMP threads spin),
:mod:`.clihelp` (every command's ``--help``)."""
