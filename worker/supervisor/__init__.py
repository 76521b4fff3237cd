"""A worker's supervisor side, torch-free: register, claim, prepare and launch a job, supervise its process
(lease, fence, memory, stop), lead a job's ranks on a host other than rank 0's, keep the job log, and report
the worker's own state. The job process (torch) is the rest of worker/.

May import: trainyard.app's torch-free core (never its API), and of worker/ only what the fork server
runs in a job process (fork_server), the errors, and what classifies a job process's ending (broken_links)."""
