"""Benchmark: how long `meshplan plan` takes for today's large models (issues 20 and 23).

Targets (issue 20): llama3-70b on 8x8xH100-80GB at sequence 8192 and global batch 512 in at most
60 s on the development machine (2 CPU cores); llama3-405b on 128x8xH100-80GB in at most 180 s;
mixtral-8x7b on 8x8xH100-80GB in at most 90 s (both at global batch 512 and their models' default
sequence, 8192 and 4096). llama3-8b on one host of 8 H100s at global batch 8 is a quick case
without a target.

Each run is a fresh process running the CLI (``python -m runtime.cli plan MODEL --cluster C
--batch G --json FILE``), so no cache of an earlier run helps (DTensor strategies, meshes): the
wall time is what a user waits for, interpreter start and imports included. Also recorded per run:
the planner's own time (``planner_time_s`` of the plan), the CPU seconds of the process (on a
shared machine a better measure of the work than the wall time), the load average before and
after, and the plan's predicted iteration time (so a faster planner that changed its answer is
seen). A case passes when the median wall time is at most its target.

    python -m benchmarks.planning_time [--repeat 3] [--only NAME ...] [--json FILE]

Results go to ``benchmarks/results/planning-time.json`` with the date and the machine (cases of
earlier runs not run again are kept, each with its date).

Where the time goes (CPU seconds of one `planner.api.plan` with one solver thread, so that the
phases do not overlap; 2026-11-25 on this 2-core machine at load 2.5-4, so the figures are
inflated by other processes; the phases are exclusive; before: the same plan at commit
6b6a18b, total only):

==========================  ==========  ===========  ============
phase                       llama3-70b  llama3-405b  mixtral-8x7b
==========================  ==========  ===========  ============
HiGHS (ILP solves)                29.3         89.1         268.4
tracing (6 micro-batches)         22.6         33.3          28.0
DTensor strategies                18.7         27.5          32.4
edge (resharding) prices          10.2         14.3          23.4
other intra-op pass work           7.8         12.8           9.9
solution summaries                 6.5         11.6           7.8
layer profiles                     4.3          6.8           5.9
dominance pruning                  3.7          4.0          21.3
ILP build                          3.2          3.4          18.3
cost graph                         2.5          3.8           5.9
stage DP and the rest              3.9          4.9           3.2
total                            112.8        211.5         424.2
total before                     222.3        412.7         806.8
==========================  ==========  ===========  ============

Each plan solves its micro-batch sizes (1 to 32, six) one after the other, each with a trace,
strategies and prices per logical mesh and 30-50 intra-op programs (time-optimal, memory ladder,
Megatron seeds). HiGHS gets the programs as arrays without probing
(`planner.intra.highs`) after exact dominance pruning (`planner.intra.dominance`); node prices
are shared by the copies of a block and edge prices by tensors of one size. What is left is
repeated per micro-batch size: the trace and the strategies differ by the batch dimension.

Since that table (same day, later commits): HiGHS runs without the feasibility-jump heuristic
and symmetry detection (`planner.intra.highs`), the micro-batch sizes are searched in worker
processes, one per core (`planner.size_search`), and FSDP joined the search (one more option
per parameter, one more seed solve per mesh: more work). Median of 3 with these, on this
machine (the load average counts the planner's own two processes): llama3-70b 75.3 s wall
(144 s CPU; target 60 s), llama3-405b 116.3 s (223 s CPU; target 180 s), mixtral-8x7b 191.9 s
(376 s CPU; target 90 s), llama3-8b 21.4 s, with the same predicted iteration times as before
these changes except llama3-8b at global batch 8 (0.938 -> 0.874 s: FSDP). In mixtral-8x7b's
plan HiGHS took 152 s of the 240 s of CPU of one process searching every size (339 programs;
six memory-limited ones took 4-35 s each, mostly in sub-MIP heuristics and restarts).

2026-11-26: HiGHS first solves each program's LP relaxation without presolve and keeps it
when it is integral (`planner.intra.ilp.ILPModel.solve`); the memory ladder's rungs, whose
relaxation is fractional where the budget binds, stop at a relative gap of 1e-4
(`planner.inter.stage_solves.LADDER_GAP`). mixtral-8x7b at 16 rows per micro-batch, one
process: 98 of 102 relaxations (16 and 4 rows) were integral; HiGHS 32.5 -> 3.2 s of CPU and
the size's search 84.7 -> 45.1 s of CPU, with the same plan (6.797 s per iteration). The same
day the search gained two seeds per mesh (Megatron-SP where a tensor-parallel axis exists,
every parameter HSDP where the mesh spans hosts) and recomputation three ways (none,
selective, full): llama3-70b at 4 rows per micro-batch, one process, 33.6-34.4 s of CPU with
them against 29.5-29.6 s without (same plan). Single runs after all of it (2026-11-26
08:22-08:31, load 1.4-2.2): llama3-8b 26.3 s, llama3-70b 100.5 s (191.5 s CPU), llama3-405b
183.4 s (347.1 s CPU), mixtral-8x7b 194.7 s (381.4 s CPU): every target missed. This machine's
speed moved by about a quarter within minutes that day: three runs of llama3-70b at
08:17-08:21 took 83.6, 88.0 and 90.2 s (159.5-172.6 s CPU) with the same code, and one size
of it 27 s of CPU at 08:21 and 34 s at 08:31. What is left per size (llama3-70b, 4 rows,
py-spy): tracing 18%, interpreter start and imports 9%, DTensor strategies 12%, edge prices
and the cost graph 12%, attributing solutions to layers and summing them (`profile`,
`_summarise`) 18%; HiGHS 5%.

2026-11-26 12:18-12:28, after the stage DP became exact and zero bubble, context parallelism
(one more seed per mesh where micro-batches have one row) and received-value placements joined,
on a quiet machine (load 0.7-2.5, the planner's own processes included): llama3-8b 18.4 s,
llama3-70b 63.6 s (single run) and then 60.9, 62.5 and 63.1 s (median 62.5 s, 119 s CPU; target
60 s: 4% over), llama3-405b 112.5 s (214 s CPU; target 180 s: pass), mixtral-8x7b 151.4 s (294 s
CPU; target 90 s). The single runs of 08:22-08:31 took 100.5, 183.4 and 194.7 s at a similar
load, and no change between them aimed at speed (the exact DP and the new seeds add work); what
made the difference was not found. This machine's speed moved by a quarter within minutes that
day (above), so these are not yet a median of 3 except llama3-70b's.

2026-11-26 afternoon, where the time goes now (issue 23), per micro-batch size: one
`planner.api.plan` at the size of the case's plan with MESHPLAN_PLANNER_PROCESSES=1 and the
per-mesh solves run in the calling thread, under cProfile with ``time.process_time`` as its
clock (CPU seconds, the profiler's own overhead included: about twice an unprofiled run; the
machine was at load 5-24, shared by other agents). Phases are cumulative times of
`planner.inter.stage_table.profile` (layer profiles), `planner.intra.prices.node_options`
(DTensor strategies), `planner.intra.prices.edge_matrices`, `planner.intra.ilp.ILPModel.solve`
(HiGHS), `planner.intra.solve._reduce` and `ILPModel.__init__` less the prices (ILP build),
`_summarise` (solution summaries). "before": commit b7cf74a; "after": held-memory terms kept
per solution (`planner.inter.held_memory`: they were recomputed for each of the 3-4 layer
clusterings a solution is attributed to) and resharding steps kept per placements
(`cost_models.resharding.reshard_steps`). Unprofiled, gpt-39b's size took 14.6-17.9 s of CPU
before and 12.7-16.5 s after (four alternating runs each, load 5-8, the spread is the
machine's): the profiler inflates small Python calls, which is where the saving lies.

==========================  ==============  ==============  ===============  ===============
CPU s (profiled)            gpt-39b before  gpt-39b after   mixtral before   mixtral after
==========================  ==============  ==============  ===============  ===============
DTensor strategies                    12.0            11.3             78.1             79.7
edge (resharding) prices               8.5             6.0             58.7             42.8
tracing (one size)                    12.3            12.5             45.8             39.0
layer profiles                        27.3            11.5             79.5             33.6
ILP build                              3.7             3.5             22.5             23.5
HiGHS (ILP solves)                     1.2             1.1             16.0             16.2
solution summaries                     5.2             4.8             14.2             14.2
node prices                            1.0             0.9              3.9              4.1
stage tables and DP                    0.4             0.4              3.0              3.2
the rest (model build, ...)           12.5            12.0             15.0             14.5
total                                 84.3            64.0            336.8            270.9
==========================  ==============  ==============  ===============  ===============

gpt-39b: 8x8xV100-16GB, global batch 1024, 1 row per micro-batch (its plan: tp4 x pp16,
55.359 s per iteration before and after). mixtral-8x7b: 8x8xH100-80GB, global batch 512, 16
rows per micro-batch (7.604 s per iteration before and after, the same three stages). HiGHS is
no longer what planning waits for: what is left is Python work repeated per micro-batch size
and per logical mesh (the trace, DTensor's strategies and the resharding prices differ with the
batch dimension and the mesh), each of which would need sharing across processes or meshes.

2026-11-26 evening (issue 23, the intra-op program side): the ILP is built without a Python
loop per variable or row (`planner.intra.ilp.ILPModel`: each edge's marginal rows as arrays,
the columns put in pulp's order, by name, from their numbers without making the names), edge
prices make the tensor's size key once per matrix and each gradient's expected placement once
per row, the backward terms of `planner.inter.held_memory` are kept per (node, option) for
every solution of a pricing, recomputation and zero-bubble tables read forward times and
activation bytes from the solution's node values, the layer of each node is kept per
clustering, and memory-ladder rungs that land on an earlier solve's choice of the same
program reuse its summary (gpt-39b at 1 row per micro-batch: 44 distinct choices in 54
solves). Plans are unchanged: the whole plan JSON (planner time aside) is equal before and
after for llama3-8b (1x8xH100-80GB, batch 8), llama3-70b at 4 rows per micro-batch,
mixtral-8x7b at 16 and gpt-39b at 1. gpt-39b at 1 row, one process, solves in the calling
thread, cProfile with ``time.process_time`` (load 4-7): 62.7 -> 55.3 s of CPU in all, the
per-mesh passes (`profiles_for`) 44.9 -> 35.9 s, edge prices 6.8 -> 4.4 s, layer profiles
12.2 -> 7.7 s, ILP build 1.9 -> 1.0 s. Unprofiled (one process, `/usr/bin/time`), the saving
is within this machine's noise (shared by other agents): gpt-39b at 1 row 17.6 and 16.3 s of
CPU before, 17.0 and 13.7 s after (alternating, load 7-13); llama3-70b at 4 rows 42.4 s
before, 43.4 s after (load 6-7); mixtral-8x7b at 16 rows 61.8 and 79.1 s before, 62.2 and
66.3 s after (run before, after, after, before; load 4-6). No target was re-measured. What
planning waits for is still outside this side: DTensor's strategies and the trace, per
micro-batch size and logical mesh.

2026-11-26 evening (the machine at load 7-30, shared with other agents and the runs below, so
whole-run times are not comparable with the figures above). Two changes, the same plans (the
whole plan JSON but the planner time, for llama3-8b, gpt-39b, llama3-70b and mixtral-8x7b).
gpt-39b before and after run side by side (the same load, 3-7), twice: 182.4 -> 165.1 s and
160.0 -> 152.8 s wall, 104.4 -> 93.1 and 97.5 -> 89.3 s of CPU. (1) the planning process
searches sizes itself, from the back of the list, while n - 1 workers take them from the front
(`planner.size_search.share`): one spawned worker fewer on two cores, whose imports alone
(``import planner.size_search``) take 3.3-4.4 s of CPU at that load; llama3-8b 67.1 -> 58.0 s
of CPU and gpt-39b 96.7 -> 82.4 s (single runs of the CLI, load 7-17). (2) DTensor's strategy
functions run without their redistribution costs (`planner.intra.dtensor_rules`, the same
strategies on seven models): DTensor's part of the strategies of one size, every op signature
on every mesh of the case, alternating with and without in one process, CPU s: llama3-70b at 4
rows 4.4-7.0 -> 2.3-2.7, mixtral-8x7b at 16 rows 15.2-15.9 -> 9.6-10.4, gpt-39b at 1 row
2.0-2.5 -> 1.2-1.7.

2026-11-28 (issue 23): the cases gpt-39b (target 20 s), gpt-1t (60 s) and the slowest committed
case of each of the GPT, MoE and Wide-ResNet suites (60 s, read from the results files:
`slowest_case`) joined, run with the case's dtype and optimizer and `--quiet`;
`benchmarks.bench_planner` runs them. Exact changes (every layer profile and interleaved cut
hashed before and after: equal for gpt-39b at 4 rows and llama3-8b at 1 and 2): a layer
profile's per-clustering work vectorised (its replay for the 354 profiles of gpt-39b at 4
rows, caches warm, 2.46 -> 0.57 s), the stage table's options kept as an index array, one
min-max DP for all chunk counts of an interleaved cut, FSDP edge prices shared by equal
edges. gpt-39b, whole plan, fresh processes, alternating the commit before (1f7da67) and
after, load 0.3-1.9: 64.9 and 62.5 s before, 60.9 and 63.8 s after (and 66.9-69.4 s in the
median-of-3 run just before): no change this machine's noise does not cover. A size of
gpt-39b (1 row, one process, solves in the calling thread) took 14.4 and 11.9 s of CPU
before, 10.9 and 11.3 s after.

2026-11-29: llama3-70b, median of 3, 192.4 s wall (320-325 s CPU, load 1.4-1.8; target 60 s).
The 62.5 s above is not what the code of that day does: commit b7cf74a, which recorded it, plans
65.41 s per iteration (the recorded plan: 60.08 s) and took 232 s planning the six sizes in one
process this morning, and HEAD 266 s (seven sizes: one row per device, 64, is always tried;
`planner.api.larger_microbatch_sizes`), at about 35 s per size, every size alike. gpt-39b took
64.7 s the same morning (68.8 s the day before): the machine is not the difference. Each run now
records `python_speed` beside it. Single runs after it: llama3-405b 371.2 s (target 180 s;
its plan 23.03 s per iteration, one micro-batch of all 512 rows, against 30.06 s on
2026-11-26), mixtral-8x7b 309.8 s (target 90 s; 6.818 s per iteration, 6.798 s on
2026-11-26). Exact changes of that day, plan JSON equal before and after for llama3-70b at 4 rows, gpt-39b at 1 and llama3-8b at 2: `OpGraph.ops` made once (it was a
new list per access), a stage's backward seconds per op kept per solution and layer map
(`planner.inter.dp_overlap._backward_seconds`; the gradient-bucket pricing of the 17 candidate
plans of a size looped over every op of the model per stage: 8.5% of a size's samples of
llama3-70b at 4 rows, 0.7% after), and the interleaved cut DPs restricted to the rows and
columns a cut can reach (1.3x on 82 layers). Where a size's time goes (py-spy, 50 Hz,
llama3-70b at 4 rows, one process): layer profiles 18%, the mesh search's own work 10%,
solution summaries 9%, DTensor strategies 7%, the trace 7%, HiGHS 7%, the interleaved search
6%, edge prices 5%, imports 5%: no single part whose removal would meet the target.

2026-11-29, later. This machine is now an Intel Xeon whose Python is slower and varies more
(`python_speed` 0.11-0.19 s, against 0.095-0.097 the day before): compare runs of one day.
Exact changes, the same plans (predicted iteration time equal to the last digit for
llama3-70b and gpt-39b, whole plans and single sizes): what the per-solution passes read of
the graph alone is made once per pricing instead of once per solution (full recomputation's
blocks and edges, the ops selective recomputation changes, the inputs the held-memory passes
look at, the weight products zero bubble defers, the cost table's layout, the intra-op
program's edge classes), option subsets once per pair of lists, the data-parallel filter once
per options list, the repeated blocks once per graph, and a logical mesh keeps its
collectives' prices. Fresh CLI runs, the commit before (f3a82c5) against after: llama3-70b
268.4 -> 191.5 s wall, 448 -> 330 s CPU (single runs, python_speed 0.124 and 0.131), and
after, median of 3 in the results, 210.1 s (350-367 s CPU); gpt-39b 101.6 s (167.6 s CPU)
-> median of 3 82.9 s (116-140 s CPU). Both still miss their targets (60 s, 20 s) by 3.5x
and 4.1x. mixtral-8x7b after, a single run: 496.1 s (862 s CPU, python_speed 0.18; the same
plan as the 309.8 s run at 0.095 that morning). Where a size's time goes
now (py-spy ``--gil``: samples of the thread holding the GIL, the planner being one core of
Python; llama3-70b at 4 rows, one process): the trace 14%, DTensor strategies 13%, building
the intra-op programs (edge prices mostly) 11%, layer profiles 10% (19% before), solution
summaries 8%, imports 7%; HiGHS runs outside the GIL beside them.

2026-11-29, afternoon. Exact changes, the same plans (the whole plan JSON, planner time aside,
equal before and after for llama3-70b at 4 rows and for its whole plan): DTensor's pairs are
enumerated once per probe mesh, each axis size replaced by its smallest prime factor, and
filtered per real mesh (`planner.intra.strategies._probe_pairs`: a superset, since the registries
read the axis sizes only to ask whether a dim splits over them; no strategy differed on 13 models
at two sizes each on 40 meshes), so the 13 two-axis meshes of 64 devices share one enumeration
per op signature; edge price matrices priced per distinct (placement, placement) pair; the
resharding step plans kept per pattern of axes with more than one device. One size (llama3-70b
at 4 rows, one process, alternating before (a08bf38) and after): 49.8 and 54.9 s of CPU before,
46.3 and 50.9 s after; DTensor strategies 11% -> 3% of the samples. The whole plan, fresh CLI
runs back to back: 165.5 s wall (286 s CPU) before, 150.1 s (260 s CPU) after. Also the size
tried in any case (one row per device, 64 rows) is now searched beside sizes 1 to 32 instead of
after them, which changes nothing on two cores (seven equal sizes on two processes take four
rounds either way) and saves a round where there are seven or more cores. The median of 3 in
the results, taken an hour later on the same code at python_speed 0.13-0.21 (the machine slower
again): llama3-70b 194.6 s (313-364 s CPU), gpt-39b 74.2 s (127-131 s CPU). Still 3.2x and 3.7x
over their targets. What a size spends now (py-spy --gil, llama3-70b at 4 rows): the trace 19%,
layer profiles 15%, building the intra-op programs 11% (edge prices 7%, of which the resharding
prices themselves 4%), the mesh search's own work 10%, solution summaries 9%, imports 9%,
DTensor strategies 3%: Python work per op of the whole model, repeated per solution and per
micro-batch size; the next factor needs those passes run once per repeated block rather than
once per op of each copy.

Pruning by a proven lower bound (issue 23) would skip nothing on these cases: the least
iteration time any plan can be predicted to take (`benchmarks.ceiling`, the whole model on one
device at the whole batch over the devices) is 0.75-0.80 of the best plan's time in the suites'
records (`benchmarks/results/REPORT.md`: bound against automatic TFLOP/s per device, 635 vs
503 for llama3-70b and 560 vs 417 for mixtral-8x7b on 64 H100s, 96 vs 71 for gpt-39b on 64
V100s). A micro-batch size's own bound (each GEMM at that size's efficiency) is barely above
it for the llama and mixtral cases, whose GEMMs' smallest dimension is the hidden size at every
size (4096-8192 rows of sequence per micro-batch); it falls as the size grows, so for gpt-39b,
fastest at 1 row, no size's bound exceeds the 1-row bound, which its best plan already exceeds.

2026-11-29, evening: where mixtral-8x7b's plan waits. Each size of one CLI search timed
(17:38-17:45, load 1.1-1.3, the planning process and one forked worker): 52-89 s of CPU for
1, 2, 16, 32 and 64 rows, but 173 s for 4 and 194 s for 8 (the plan: 8 rows, 6.818 s per
iteration; 393 s wall). At 8 rows in one process, one solver thread: 70 intra-op programs,
5 of them to branch-and-bound (relaxation fractional), and one of those, the memory ladder's
first rung (0.35 of the time-optimal memory) on the 4x8 submesh, took 128 s of the size's
160 s of solves: 52,211 columns, 2,231 binaries, a root bound 3.7% below the optimum and 458
nodes to prove it within `LADDER_GAP` (147 s when run again alone with HiGHS's log; its first
incumbent, at 10 s, was 2.6% above the optimum). HiGHS's node limit does not make it a cheap
sample: 20, 50 and 100 nodes took 36, 57 and 70 s (the root and two restarts alone about
14 s). A price on memory instead of the budget (minimise time + lambda * memory, no memory
row; lambda by bisection) solves that program's relaxation in 0.3-0.5 s, integral at every
lambda tried, but the frontier's convex hull has no point near the rung: 45,600 MiB at 0.0707
(scaled time) just above lambda = 4.34e-6, 37,522 MiB at 0.1059 just below it, where the rung,
within 42,692 MiB, is 0.0866: priced samples would lose that point. Left as it is: a
cheaper rung (a limit, or priced samples) is another point of the time-memory trade-off, so
plans may change, and showing they do not get slower needs the suites re-run.

2026-11-30: the trace, 14-19% of a size, made proportional to what is new: the built-in models'
stacks are traced three blocks deep and the rest written from that trace
(`planner.tracing.repeat`; the graph equal node for node, tests/test_repeat.py). One trace in a
warm process, float32: llama3-70b at 4 rows 10.3 -> 2.8 s of CPU, mixtral-8x7b at 4 rows 7.9 ->
3.7 s, gpt-39b at 1 row 3.3 -> 0.8 s. Whole plans, fresh CLI runs alternating the commit before
(4c257b5) and after, the machine slow that morning (`python_speed` 0.14-0.23 s, against
0.11-0.19 the day before): gpt-39b 125.2 and 93.7 s wall (168.5 and 157.7 s CPU) before, 77.6
and 86.8 s (130.0 and 145.5 s CPU) after; llama3-70b 275.9 s (476.4 s CPU) before, 236.0 s
(410.0 s CPU) after, at python_speed 0.229 and 0.234. The plan JSON, planner time aside, is
equal before and after for both. Median of 3 in the results, on commit 3ed4671 (which also
built a named model once per plan instead of once per size: 0.3-0.8 s of CPU per size after a
process's first build, within the noise of two alternating pairs of gpt-39b runs; reverted,
since a user's factory is called per size and the tests make a worker fail through it),
python_speed 0.13-0.22:
gpt-39b 79.8 s (133-140 s CPU), llama3-70b 212.9 s (376-385 s CPU); 4.0x and 3.5x over the
targets. llama3-70b's plan is 63.250 s per iteration, as 4c257b5's; the record of 2026-11-29
had 63.258 s (which commit between them moved it was not looked for). What a size of
llama3-70b spends now (py-spy --gil, 4 rows, one process, one solver thread): the per-mesh
passes 60% (solution summaries 12%, building the programs 9%, pricing 8%, layer profiles 19%
of which held-memory terms 10%), the mesh search's own work 11%, imports 7%, the trace 6%,
the process's first model build 5%; no line of our code above 3.2% of the samples.

2026-12-01: mixtral-8x7b's rung of 2026-11-29 (above) made exact and cheaper. With HiGHS's log,
that program (8 rows, the 4x8 mesh, 52,211 columns) restarted twice at the root after presolve,
each restart solving the root of a program reduced by 17.9% and then 3.4%; without presolve it
took 18.7 s instead of 72.0 s to the same optimum within `LADDER_GAP`. Over the 42
branch-and-bound programs over 0.5 s of llama3-70b and mixtral-8x7b (every size, one process),
seconds with presolve / without: llama3-70b's 15 (11-23K columns) 12.8 / 22.8, where the
restarts shrank two 20K-column programs to under 1K columns (0.6 / 5.0 and 0.7 / 7.2 s);
mixtral-8x7b's 15 over 30K columns 144.1 / 61.7 and its 12 smaller ones 27.9 / 20.5. So
programs of over 30K columns went without presolve (commit 10f0f26; replaced by the rule
below); llama3-70b's never reach it. Whole plans (one `planner.api.plan` per process, default two
processes, python_speed about 0.094 s): mixtral-8x7b 198.5 s wall (355 s CPU) with presolve
everywhere, 146.4 s (270 s CPU) with it nowhere, 149.4 s (277 s CPU) with the threshold, each
plan 6.81818971505199 s per iteration; llama3-70b 74.5 s with presolve everywhere, 78.3 s with
it nowhere (plan 63.2380 s instead of 63.2503 s: other rungs within the gap), 78.7 s with the
threshold (63.2503 s, as before). The median of 3 in the results: mixtral-8x7b 161.1 s
(280-316 s CPU; 1.79x over 90 s). Tried and dropped: a warm start of the relaxation from the
previous budget's basis (0.25 against 0.30 s on the largest program), the primal simplex and
presolve for the relaxations (38.4 and 4.2 s against 1.2 s on seven programs, each with and
without its memory row), restarts off with presolve on (51.7 s on the largest), presolve at the
root only (62.7 s), more heuristic effort (57.1 s at 1.0).

The same day, later: the column count was the wrong signal. llama3-405b's programs (11-12K
columns, seven of one size) took 26.2 s with presolve and 19.2 s without, and mixtral-8x7b's
smaller ones also went faster without it. What tells the programs apart is the LP relaxation
solved just before: llama3-70b's two programs that presolve sped up tenfold leave two binaries
fractional, one node split between two strategies, at a root bound 0.02% below the optimum,
so reduced-cost fixing removes most of the program at the first restart; the programs that
went faster without presolve leave 4 to 192 fractional. So presolve now runs only where the
relaxation leaves at most two binaries fractional (`planner.intra.highs.presolve_for`). Over
the 49 programs, seconds with presolve / without / by this rule: llama3-70b 14.4 / 24.1 /
12.4, mixtral-8x7b 172.0 / 82.2 / 79.2, llama3-405b 26.2 / 19.2 / 19.2 (the rule was chosen
on these programs). Whole plans, one run each (python_speed about 0.094 s): mixtral-8x7b 145.4
s wall (265 s CPU), llama3-70b 73.2 s, llama3-405b 173.6 s (195.6 s on commit 60b7663, whose
column threshold left every llama3-405b program presolved, run just after), all three plans as
before to the last digit. Then the median of 3 in the results: llama3-405b 166.5 s (164.2-172.6 s
wall, 293-313 s CPU, python_speed 0.093-0.101 s): within its 180 s target (0.93) on this day.

2026-12-02, where cores sat idle or work was done twice; every change exact (the same sizes
compared and the same plans). (1) The larger micro-batch sizes were walked one at a time in the
planning process while the other core idled: gpt-15b on 4x8 A100s (slowest-gpt) searched 1 to
32 rows on two processes in 34 s, then 64, 128, 256 and 512 rows (each winning) one after
another in 50 s. Each size the walk needs is now searched beside the next sizes it may try,
one per process (`planner.api._walk_larger`): fresh CLI runs, load 0.9-1.1, 82.2 -> 57.9 s of
planner time, the plan 14.599 s per iteration both times. (2) The GShard MoE's stack did not
repeat from its first unit (the auxiliary losses' running sum starts in block 0 when it holds
experts, so the second unit reads the first's loss where the third reads the second's sum),
and every MoE of the suite was traced twice, short then whole: the stack is now tried again a
unit later (`planner.tracing.repeat.repeated_trace`): moe-70b 3.7-6 s -> 1.4-2 s per size's
trace. (3) The stage DP scanned every candidate t_max from the least, most of them infeasible,
and stopped only where (B - 1) t_max alone reached the best latency: it now bisects to the
first feasible one and stops where the least sum of stage latencies plus (B - 1) t_max does
(`planner.inter.stage_dp._search`): moe-70b at 8 rows, its six DPs 5.5-6.4 -> 1.0 s of CPU.
(4) `with_zero2` found each option by `list.index`, comparing dataclasses: 22 -> 8 ms per
variant on moe-2.4b. moe-70b on 8x8 A100s (slowest-moe), fresh CLI runs: 171.4 s before (2),
158.7 s with (2) in a first form (the model's losses stacked after the stack, reverted since:
it moved a plan), still 2.6x over 60 s; a size there costs 35-45 s
of CPU, of which one branch-and-bound (a memory-ladder rung, 30K columns, 1.5% root gap) took
7.5 s at 8 rows.

2026-12-02, later: gpt-1t and slowest-moe recorded for the first time (median of 3, nothing else
running, load 0.7-2.7): at 2443261 gpt-1t 216.7 s (380 s CPU; target 60 s) and slowest-moe 146.2
s (270 s CPU). Then work repeated per logical mesh or per layer range that reads the graph alone,
made once (exact: the whole plan JSON, planner time aside, equal before and after for gpt-39b at 1
row, llama3-8b at batch 8, moe-10b on 2x8 V100s at 4 rows and gpt-1t at 16): what a pricing
reads of the graph (node set, edges, representatives, saved values, gradient edges, and what
`PricedStage.per_pricing` keeps: edge classes, recomputation structures) once per graph and node
set instead of once per logical mesh (gpt-1t has 71 per size); a solution's parameter-gradient
edges once, not once per stage range priced (`planner.inter.dp_overlap._grad_edges`); a seed's
least parameter bytes per layer read once per block representative (`_seed_params_per_layer`);
the boundary bytes once per clustering, not per candidate. One size in one process (a second
process running beside it): gpt-1t at 16 rows 57.7 -> 43.2 s of CPU, moe-10b at 4 rows 20.1 ->
16.9 s, gpt-39b at 1 row 11.2 -> 10.3 s, llama3-8b 26.3 -> 24.9 s. Median of 3 after: gpt-1t
164.3 s (287 s CPU, 2.74x over), slowest-moe 145.8 s (276 s CPU, 2.43x over: within the noise
of the runs before, 131.7-146.9 s; its sizes wait on HiGHS and per-solution work, not on
these), gpt-39b 43.3 s (74 s CPU, 2.17x over its 20 s; 79.8 s on 2026-11-30, a slower day,
`python_speed` 0.15-0.22 s against 0.09-0.11 s), every plan as before (70.679, 2.601 and 55.403
s per iteration).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.records import RESULTS, machine, write_results

DEFAULT_JSON = RESULTS / "planning-time.json"


@dataclass(frozen=True)
class Case:
    """One planning problem: model, cluster, global batch, and the most seconds allowed."""

    model: str
    cluster: str
    global_batch: int
    target_s: float | None
    dtype: str = "float16"
    optimizer: str = "adam_mixed"


GPT_1T = "gpt:hidden=25600,layers=128,heads=160,seq=2048,vocab=51200"

CASES = {
    "llama3-8b": Case("llama3-8b", "1x8xH100-80GB", 8, None),
    "llama3-70b": Case("llama3-70b", "8x8xH100-80GB", 512, 60.0),
    "llama3-405b": Case("llama3-405b", "128x8xH100-80GB", 512, 180.0),
    "mixtral-8x7b": Case("mixtral-8x7b", "8x8xH100-80GB", 512, 90.0),
    # issue 23: gpt-39b in at most 20 s, the 1T GPT in at most 60 s
    "gpt-39b": Case("gpt-39b", "8x8xV100-16GB", 1024, 20.0),
    "gpt-1t": Case(GPT_1T, "384x8xA100-80GB", 3072, 60.0),
}
#: The predicted suites whose slowest committed case is a case here ("slowest-SUITE").
SLOWEST_OF = ("gpt", "moe", "wresnet")


def slowest_case(suite: str) -> Case:
    """The case of `suite` whose automatic plan took longest to plan in the committed results
    (any device; issue 23: every case of every suite in at most 60 s)."""
    best, slowest = -1.0, None
    for path in sorted(RESULTS.glob(f"{suite}-*.json")):
        for c in json.loads(path.read_text())["cases"]:
            seconds = (c.get("auto") or {}).get("planner_time_s") or 0.0
            if seconds > best:
                best, slowest = seconds, c
    if slowest is None:
        raise RuntimeError(f"no committed results of the {suite} suite in {RESULTS}")
    return Case(
        slowest["model"],
        slowest["cluster"],
        slowest["global_batch"],
        60.0,
        slowest.get("dtype", "float16"),
        slowest.get("optimizer", "adam_mixed"),
    )


def all_cases() -> dict[str, Case]:
    """`CASES` and the slowest committed case of each of `SLOWEST_OF`."""
    return CASES | {f"slowest-{s}": slowest_case(s) for s in SLOWEST_OF}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def python_speed(repeats: int = 3) -> float:
    """CPU seconds of a fixed piece of pure-Python work (dict and list building, attribute
    lookups, arithmetic: what the planner's own loops do), the least of `repeats`: recorded
    beside every run, so that figures of different days can be set against this machine's
    speed at the time (its speed has moved by a quarter within minutes and by more between
    days)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        table: dict[int, tuple[int, float]] = {}
        for i in range(300_000):
            table[i] = (i % 7, i * 0.5)
        total = 0.0
        for a, b in table.values():
            if a:
                total += b / a
        sorted(table, key=lambda k: -table[k][1])
        best = min(best, time.process_time() - t0)
    return best


def run_once(case: Case) -> dict[str, Any]:
    """Plan `case` once in a fresh CLI process; its wall and CPU seconds, planner time, load
    averages, the plan's predicted iteration time and `python_speed` just before."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [
            sys.executable,
            "-m",
            "runtime.cli",
            "plan",
            case.model,
            "--cluster",
            case.cluster,
            "--batch",
            str(case.global_batch),
            "--dtype",
            case.dtype,
            "--optimizer",
            case.optimizer,
            "--quiet",
            "--json",
            str(out),
        ]
        speed = python_speed()
        load_before = os.getloadavg()
        cpu0, t0 = _children_cpu(), time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}"
            )
        plan = json.loads(out.read_text())
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "planner_time_s": round(plan["planner_time_s"], 2),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "iteration_time_s": plan["estimate"]["iteration_time_s"],
        "num_microbatches": plan["num_microbatches"],
        "python_speed_s": round(speed, 4),
    }


def run_case(name: str, case: Case, repeat: int) -> dict[str, Any]:
    """`repeat` runs of a case, with their median wall time against the target."""
    runs = []
    for i in range(repeat):
        print(
            f"{name}: run {i + 1}/{repeat} (load average {os.getloadavg()[0]:.2f}) ...",
            flush=True,
        )
        runs.append(run_once(case))
        r = runs[-1]
        print(
            f"{name}: run {i + 1}/{repeat}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, "
            f"planner {r['planner_time_s']:.1f} s",
            flush=True,
        )
    median = statistics.median(r["wall_s"] for r in runs)
    met = None if case.target_s is None else median <= case.target_s
    return {
        "name": name,
        "date": datetime.date.today().isoformat(),
        "model": case.model,
        "cluster": case.cluster,
        "global_batch": case.global_batch,
        "dtype": case.dtype,
        "optimizer": case.optimizer,
        "target_s": case.target_s,
        "repeat": repeat,
        "median_wall_s": median,
        "median_cpu_s": statistics.median(r["cpu_s"] for r in runs),
        "ratio": None if case.target_s is None else round(median / case.target_s, 3),
        "met": met,
        "runs": runs,
    }


def table(results: list[dict[str, Any]]) -> str:
    """The results as a plain-text table."""
    lines = [
        f"{'case':<13} {'median':>8} {'cpu':>8} {'target':>7} {'ratio':>6}  result  load (1 min)"
    ]
    for r in results:
        target = "-" if r["target_s"] is None else f"{r['target_s']:.0f} s"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        verdict = {None: "-", True: "pass", False: "FAIL"}[r["met"]]
        loads = " ".join(f"{x['load_average_before'][0]:.1f}" for x in r["runs"])
        lines.append(
            f"{r['name']:<13} {r['median_wall_s']:>6.1f} s {r['median_cpu_s']:>6.1f} s "
            f"{target:>7} {ratio:>6}  {verdict:<6}  {loads}"
        )
    return "\n".join(lines)


def run_cases(names: list[str], repeat: int, path: Path = DEFAULT_JSON) -> bool:
    """Run the cases `names` (of `all_cases`), print the table and merge the results into
    `path` (cases of earlier runs not run again are kept); whether every target was met."""
    cases = all_cases()
    results = [run_case(n, cases[n], repeat) for n in names]
    print(table(results))
    old = json.loads(path.read_text()) if path.exists() else {}
    kept = [c for c in old.get("cases", []) if c["name"] not in names]
    order = list(cases)
    doc = {
        "benchmark": "planning_time",
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "torch": torch.__version__,
        "timing": "wall seconds of a fresh `python -m runtime.cli plan` process per run",
        "cases": sorted(
            kept + results,
            key=lambda c: order.index(c["name"]) if c["name"] in order else len(order),
        ),
    }
    print(f"wrote {write_results(doc, path)}")
    return all(r["met"] is not False for r in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="planning time of large models")
    ap.add_argument("--repeat", type=int, default=3, help="runs per case (median)")
    ap.add_argument("--only", nargs="+", choices=list(all_cases()), help="cases to run")
    ap.add_argument("--json", default=str(DEFAULT_JSON), help="results file")
    args = ap.parse_args(argv)
    names = args.only or list(all_cases())
    return 0 if run_cases(names, args.repeat, Path(args.json)) else 1


if __name__ == "__main__":
    sys.exit(main())
