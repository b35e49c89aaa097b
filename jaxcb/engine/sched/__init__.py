"""The scheduler wing: what is decided each step, on the host, in plain Python.

base.py            BaseScheduler: the interface the engine drives, the queues and page
                   bookkeeping every scheduler shares
scheduler.py       the continuous Scheduler: decodes first, then chunked prefill under a
                   token budget, admission, prefix sharing, preemption
schedule.py        SchedulerOutput / ScheduledChunk: what one step was decided to do
policies.py        queue orders (fcfs, priority, srpf, edf) and preemption victims
page_pool.py       the KV page free list, reference counts and prefix cache
swap.py            host swap space for preempted requests' K/V, and the swap-or-recompute
                   cost model
itl_controller.py  the per-step token budget steered by measured ITL percentiles
baselines.py       static and dynamic padded-batch schedulers, to compare with
factory.py         the one factory: the scheduler, swapper and ITL controller a config asks for

A new scheduling policy is a SchedulingPolicy subclass with a `name` in policies.py:
defining it registers it under that name (nothing else in the repository changes).
"""
