# hwFSDP in C — build, grade, test.
#   make                 build the runtime, the baseline, every solution and starter
#   make run             the main job: train the debugmodel with FSDP on 4 thread-ranks (the manifest's main_job
#                        stage; in a student tree the highest stage you changed that runs)
#   make test            every test (C unit tests, PyTorch parity, solutions, grader)
#   make grade [STAGE=03] [SOLUTIONS=1]   grade your stages/: the core stages and the bonus stages you started (or one; or solutions/)
#   make reference       rebuild logs/reference/ from solutions/ (instructors)
#   make reference-check does the code still make logs/reference/? (a rebuild, compared but for wall clock and addresses)
#   make blas-check      the BLAS-sensitive tests and reference-check under a second OpenBLAS kernel
#   make plots RUN=dir [REF=dir]          PNGs for a run directory
#   make handout         the student tarball (no solutions/)
#   make bench           benchmarks (prints a table, writes results/bench.json)
#   make fsdp2-check [STAGE="01 04"]      the solutions against real PyTorch FSDP2 (instructors; installs torch once)
# Optional parts are detected; override with NO_MPI=1, NO_CUDA=1. Missing packages the build needs (gcc,
# libc6-dev, libopenblas-dev) stop it at once with one line and the apt-get command (mk/deps.mk).

CC      ?= gcc
PYTHON  ?= /usr/bin/python3
BUILD   ?= build
OPT     ?= -O2
# -Wno-missing-field-initializers: a struct of the runtime's API (KernelCost, ...) may grow fields; code that
# names its first ones, {COST_ELEMENTWISE, DTYPE_F32, flops, bytes}, keeps compiling (the rest are 0 by C's rule)
CFLAGS  := -std=c11 $(OPT) -g -Wall -Wextra -Werror -Wno-unused-parameter -Wno-missing-field-initializers \
           -D_GNU_SOURCE -pthread -Icommon $(EXTRA_CFLAGS)
LDFLAGS := -pthread $(EXTRA_LDFLAGS)
LDLIBS  := -lopenblas -lm
include mk/deps.mk

# ---- optional parts -------------------------------------------------------
HAVE_MPICC := $(if $(NO_MPI),,$(shell command -v mpicc >/dev/null 2>&1 && echo 1))
ifeq ($(HAVE_MPICC),1)
  CFLAGS  += -DHAVE_MPI $(shell mpicc --showme:compile)
  LDLIBS  += $(shell mpicc --showme:link)
endif
NVCC      := $(if $(NO_CUDA),,$(shell command -v nvcc 2>/dev/null || (test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda/bin/nvcc)))
CUDA_HOME ?= $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(NVCC)),/usr/local/cuda)
HAVE_NCCL := $(if $(NVCC),$(shell test -e $(CUDA_HOME)/include/nccl.h -o -e /usr/include/nccl.h && echo 1))

.DEFAULT_GOAL := all

# ---- the stages (generated from the stage manifest, grader/rubric.json) -----------
# STAGE_IDS, STAGE_DIRS, TRAINING_STAGE_DIRS, MAIN_JOB_DIR, STAGE_FLAGS_<dir> (STAGE_FLAGS_W3_<dir>: at world 3)
STAGES_MK := $(BUILD)/stages.mk
include $(STAGES_MK)
$(STAGES_MK): grader/rubric.json grader/manifest.py
	@mkdir -p $(dir $@)
	@$(PYTHON) grader/manifest.py mk > $@.tmp.$$$$ && mv $@.tmp.$$$$ $@  # a name of its own: two builds may remake it at once

# Objects depend on the flags they were built with: a change (MPI found after an
# install, EXTRA_CFLAGS) rebuilds them instead of linking stale ones.
FLAGS_STAMP := $(BUILD)/.flags
$(shell mkdir -p $(BUILD); printf '%s\n' '$(CC) $(CFLAGS) $(LDLIBS)' | cmp -s - $(FLAGS_STAMP) || \
        printf '%s\n' '$(CC) $(CFLAGS) $(LDLIBS)' > $(FLAGS_STAMP))

# ---- sources ----------------------------------------------------------------
#   common/runtime/  the shared runtime (libhwfsdp.a)   common/model/  Llama, ops, optimizer, data, I/O (libhwfsdp.a)
#   common/cpu/      the CPU backends and kernels (libhwfsdp.a); the CUDA build's are common/cuda/ (mk/cuda.mk)
#   common/driver/   the training loop every hw_fsdp.c links with (DRIVER_OBJ); baseline.c is an hw_fsdp.c
HEADERS    := $(wildcard common/*.h common/*/*.h)
COMMON_SRC := $(wildcard common/runtime/*.c common/model/*.c common/cpu/*.c)
COMMON_OBJ := $(patsubst common/%.c,$(BUILD)/common/%.o,$(COMMON_SRC))
# the CPU backends (runtime/backend.h), which the CUDA build (mk/cuda.mk) replaces by common/cuda/; the CPU
# kernels stay in both builds (the CUDA build's check_ops compares each CUDA kernel with its CPU one)
CPU_BACKEND_SRC := $(filter-out common/cpu/kernels_cpu.c,$(wildcard common/cpu/*.c))
DRIVER_SRC := $(filter-out common/driver/baseline.c,$(wildcard common/driver/*.c))
DRIVER_OBJ := $(patsubst common/%.c,$(BUILD)/common/%.o,$(DRIVER_SRC))
LIB        := $(BUILD)/libhwfsdp.a
TEST_SRC   := $(wildcard tests/test_*.c)
TEST_BIN   := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))
SOLUTIONS  := $(foreach d,$(STAGE_DIRS),$(if $(wildcard solutions/$(d)/hw_fsdp.c),$(d)))
STAGES     := $(foreach d,$(STAGE_DIRS),$(if $(wildcard stages/$(d)/hw_fsdp.c),$(d)))
SOL_BIN    := $(patsubst %,$(BUILD)/solutions/%/train,$(SOLUTIONS))
STAGE_BIN  := $(patsubst %,$(BUILD)/stages/%/train,$(STAGES))
BASELINE   := $(BUILD)/baseline/train

.PHONY: all detect trace-names run longrun test grade reference reference-check blas-check plots starters carry bench simulate fsdp2-check record-stream-demo \
        handout gradescope impl stage-bins tsan asan asan-test clean

all: detect $(LIB) $(BASELINE) $(SOL_BIN) stage-bins $(TEST_BIN) $(BUILD)/tests/check_ops_selftest $(BUILD)/tests/check_colls \
     $(BUILD)/tools/gpu_calibrate trace-names

detect:
	@printf 'optional parts: MPI %s  CUDA %s  NCCL %s  (a GPU is never needed to build)\n' \
	  "$(if $(HAVE_MPICC),✓,✗)" "$(if $(NVCC),✓ ($(NVCC)),✗)" "$(if $(HAVE_NCCL),✓,✗)"

# The kernels' loops vectorize (GCC's -O2 cost model leaves most of them scalar). Without
# -ffast-math the vectorizer never reorders a float reduction, so the results are the same bits.
VEC_CFLAGS := $(shell $(CC) -ftree-vectorize -fvect-cost-model=dynamic -Werror -E -x c /dev/null >/dev/null 2>&1 && \
                echo -ftree-vectorize -fvect-cost-model=dynamic)
$(BUILD)/common/model/ops.o: CFLAGS += $(VEC_CFLAGS)
$(BUILD)/common/%.o: common/%.c $(HEADERS) $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

$(LIB): $(COMMON_OBJ)
	@rm -f $@
	ar rcs $@ $^

# Every binary is one C file linked with objects and a runtime library, by one recipe for the CPU
# and the CUDA builds alike: $(call link_binary,OUT,SRC) links SRC into OUT with the binary's
#   LINK_CFLAGS  compile flags (CFLAGS, CUDA_CFLAGS; a starter adds STARTER_CFLAGS)
#   LINK_WITH    what it links besides its own file (the training driver, the runtime library)
#   LINK_LIBS    system libraries (LDLIBS, CUDA_LDLIBS)
# set per binary below (target- and pattern-specific); the defaults are the CPU training binary's.
LINK_CFLAGS = $(CFLAGS)
LINK_WITH   = $(DRIVER_OBJ) $(LIB)
LINK_LIBS   = $(LDLIBS)
define link_binary
@mkdir -p $(dir $(1))
$(CC) $(LINK_CFLAGS) -o $(1) $(2) $(LINK_WITH) $(LDFLAGS) $(LINK_LIBS)
endef

# Every FSDP implementation (baseline, solution, starter, make impl's file; the CUDA build's too) is one
# hw_fsdp.c linked with the runtime and the training driver, by $(call link_impl,OUT,SRC): link_binary's
# flags, with SRC compiled to OUT.o first and that object checked for state the ranks would share
# (tools/check_shared_state.py: the ranks are threads of one process, so a writable file-scope or
# function-static variable is one copy for all of them; one line and the build fails).
define link_impl
@mkdir -p $(dir $(1))
$(CC) $(LINK_CFLAGS) -c -o $(1).o $(2)
@$(PYTHON) tools/check_shared_state.py $(2) $(1).o || { rm -f $(1).o $(1); exit 1; }
$(CC) $(LINK_CFLAGS) -o $(1) $(1).o $(LINK_WITH) $(LDFLAGS) $(LINK_LIBS)
@rm -f $(1).o
endef

$(BASELINE): common/driver/baseline.c $(DRIVER_OBJ) $(LIB) tools/check_shared_state.py
	$(call link_impl,$@,$<)

$(BUILD)/solutions/%/train: solutions/%/hw_fsdp.c $(DRIVER_OBJ) $(LIB) tools/check_shared_state.py
	$(call link_impl,$@,$<)

# A starter's stubs leave variables unused until the student fills them.
STARTER_CFLAGS := -Wno-unused-variable -Wno-unused-but-set-variable -Wno-unused-function
$(BUILD)/stages/%/train: LINK_CFLAGS = $(CFLAGS) $(STARTER_CFLAGS)
$(BUILD)/stages/%/train: stages/%/hw_fsdp.c $(DRIVER_OBJ) $(LIB) tools/check_shared_state.py
	$(call link_impl,$@,$<)

# The stages/ binaries. In the student tree (no solutions/) a stage whose file does not build
# yet is said and left out (its old binary removed), so that make run, make test and grading
# the other stages go on; in the instructors' tree every starter must build.
stage-bins: $(DRIVER_OBJ) $(LIB)
	@$(foreach s,$(STAGES),$(MAKE) -s --no-print-directory $(BUILD)/stages/$(s)/train || { rm -f $(BUILD)/stages/$(s)/train; \
	  $(if $(strip $(SOLUTIONS)),exit 1,echo "✗ stages/$(s)/hw_fsdp.c does not build yet (errors above); everything else goes on without it"); };)

$(BUILD)/tests/%: LINK_CFLAGS = $(CFLAGS) -Itests
$(BUILD)/tests/%: LINK_WITH = $(LIB)
$(BUILD)/tests/%: tests/%.c $(LIB) $(wildcard tests/*.h)
	$(call link_binary,$@,$<)
# test_flat drives the driver's probes and checkpoint code on flat layouts built by hand (no hw_fsdp.c)
FLAT_TEST_OBJ := $(BUILD)/common/driver/probes.o $(BUILD)/common/driver/checkpoint.o
$(BUILD)/tests/test_flat: LINK_WITH = $(FLAT_TEST_OBJ) $(LIB)
$(BUILD)/tests/test_flat: $(FLAT_TEST_OBJ)

# make gpu-calibrate's program without CUDA: it times nothing, but lists the ops with their modelled times, summarizes
# given timings and holds its modelled times to the clock's (tests/test_gpu_calibrate.py; the CUDA build: mk/cuda.mk)
$(BUILD)/tools/gpu_calibrate: LINK_CFLAGS = $(CFLAGS) -DGPU_CALIBRATE_CPU
$(BUILD)/tools/gpu_calibrate: LINK_WITH = $(LIB)
$(BUILD)/tools/gpu_calibrate: tools/gpu_calibrate.c $(LIB) $(HEADERS)
	$(call link_binary,$@,$<)

# gpu-check's op harness run against itself on the CPU (tests/test_cuda_build.py)
$(BUILD)/tests/check_ops_selftest: LINK_CFLAGS = $(CFLAGS) -DCHECK_OPS_SELFTEST
$(BUILD)/tests/check_ops_selftest: tests/gpu/check_ops.c $(LIB) $(HEADERS)
	$(call link_binary,$@,$<)

# gpu-check's collectives harness on the CPU runtime: every collective vs a float64 reference, and the
# reference bits the CUDA build's run is compared with (tests/test_check_colls.py)
$(BUILD)/tests/check_colls: tests/gpu/check_colls.c $(LIB) $(HEADERS)
	$(call link_binary,$@,$<)

# grader/trace_names.py, the trace's words for the Python side, printed from the runtime's tables by
# tools/trace_names.c (as $(STAGES_MK) is generated from the rubric); the committed file is rewritten only
# when the tables changed (tests/test_trace_names.py: it is the generator's output).
TRACE_NAMES_GEN := $(BUILD)/tools/trace_names
$(TRACE_NAMES_GEN): LINK_WITH = $(LIB)
$(TRACE_NAMES_GEN): tools/trace_names.c $(LIB) $(HEADERS)
	$(call link_binary,$@,$<)
trace-names: $(TRACE_NAMES_GEN)
	@$(TRACE_NAMES_GEN) > $(BUILD)/trace_names.py.tmp.$$$$ && { cmp -s $(BUILD)/trace_names.py.tmp.$$$$ grader/trace_names.py && \
	  rm -f $(BUILD)/trace_names.py.tmp.$$$$ || { mv $(BUILD)/trace_names.py.tmp.$$$$ grader/trace_names.py && \
	  echo "wrote grader/trace_names.py (the runtime's vocabularies changed)"; }; }

# Build any hw_fsdp.c into a training binary (the grader and the mutant tests use it):
#   make impl SRC=path/to/hw_fsdp.c OUT=path/to/train
impl: LINK_CFLAGS = $(CFLAGS) $(STARTER_CFLAGS)
impl: $(DRIVER_OBJ) $(LIB)
	@test -n "$(SRC)" -a -n "$(OUT)" || { echo "usage: make impl SRC=hw_fsdp.c OUT=binary"; exit 2; }
	$(call link_impl,$(OUT),$(SRC))

# ---- the main job -------------------------------------------------------------
RUN_DIR   ?= runs/debugmodel
RUN_FLAGS ?= --flavor debugmodel --world 4 --seq-len 128 --batch-size 2 --steps 30 --warmup-steps 5 \
             --lr 3e-3 --link-gbps 20 --link-latency-us 20 --profile-steps 3
# (tools/main_job.py: the main job's solution, or in a student tree the highest-numbered stage, core or
# bonus, whose file the student changed and that runs a step, or the baseline when none does; then the
# run directory is shrunk: rank 0's memory_viz pickle over the profiled steps, the rest gzipped)
run: all
	HWFSDP_BUILD=$(BUILD) $(PYTHON) tools/main_job.py --out $(RUN_DIR) -- $(RUN_FLAGS)
	-$(PYTHON) tools/plots.py $(RUN_DIR)
	@echo "run directory: $(RUN_DIR) (open trace.json in https://ui.perfetto.dev, memory_rank0.pickle (the profiled steps) in https://pytorch.org/memory_viz)"

# The debugmodel trained 200 steps with every training solution (logs/debugmodel_200/).
LONG_FLAGS ?= --flavor debugmodel --world 4 --seq-len 128 --batch-size 2 --steps 200 --warmup-steps 10 \
              --lr 2e-3 --profile-steps 0 --quiet
longrun: all
	@set -e; $(foreach s,$(filter $(TRAINING_STAGE_DIRS),$(SOLUTIONS)),echo "training $(s)"; \
	  $(BUILD)/solutions/$(s)/train $(LONG_FLAGS) $(STAGE_FLAGS_$(s)) --out $(BUILD)/longrun/$(s); \
	  mkdir -p logs/debugmodel_200/$(s); cp $(BUILD)/longrun/$(s)/metrics.jsonl $(BUILD)/longrun/$(s)/run.json logs/debugmodel_200/$(s)/;)
	$(PYTHON) tools/plot_compare.py logs/debugmodel_200/loss.png $(addprefix logs/debugmodel_200/,$(filter $(TRAINING_STAGE_DIRS),$(SOLUTIONS)))

# ---- tests ----------------------------------------------------------------------
test: all
	$(PYTHON) tools/make_starters.py --check
	$(PYTHON) -m pytest -q -p no:cacheprovider tests

# ---- grading ----------------------------------------------------------------------
# Runs and results go to grade-runs/ (results.json); the rubric is grader/rubric.json. Without STAGE the
# grader grades every core stage and each bonus stage whose hw_fsdp.c differs from its starter (as
# stages/NN/.starter.sha256 records it) or was carried; it names the bonus stages it skipped.
# SOLUTIONS=1 on the command line replaces the list of solution directories the build
# uses (SOLUTIONS above), so `all` runs in a sub-make with the list restored.
GRADE_SOLUTIONS := $(foreach d,$(STAGE_DIRS),$(if $(wildcard solutions/$(d)/hw_fsdp.c),$(d)))
grade:
	@$(MAKE) --no-print-directory all SOLUTIONS="$(GRADE_SOLUTIONS)"
	$(PYTHON) grader/grade.py $(if $(STAGE),--stage $(STAGE)) \
	  $(if $(filter command line,$(origin SOLUTIONS)),$(if $(filter-out 0,$(SOLUTIONS)),--solutions))

# Instructors: rerun every solution on the grading configuration into logs/reference/.
reference: all
	$(PYTHON) grader/make_reference.py

# Does the code still make logs/reference/? A rebuild into $(BUILD)/reference-check compared with it
# on everything but the wall clock and the heap's addresses (a refactor must change nothing there).
reference-check: all
	$(PYTHON) grader/make_reference.py --out $(BUILD)/reference-check --work $(BUILD)/reference-check-runs --no-plots
	$(PYTHON) tools/compare_reference.py logs/reference $(BUILD)/reference-check

# The figures that depend on BLAS rounding, under a second OpenBLAS kernel (tools/blas_core.py --other: one this
# CPU runs but OpenBLAS does not pick here): parity against PyTorch and the baseline, the parity spreads, the
# bench's figures and reference-check (that one on this machine's kernel too). A figure that holds on one
# kernel's last bits only fails here, not on a user's machine. CI runs it beside make test (the machine's kernel).
BLAS_TESTS ?= tests/test_parity_torch.py tests/test_solutions.py tests/test_pipeline.py tests/test_parity_spread.py \
              tests/test_compare_reference.py tests/test_bench.py
blas-check: all
	@other=$$($(PYTHON) tools/blas_core.py --other) && here=$$($(PYTHON) tools/blas_core.py) || exit 1; \
	echo "blas-check: reference-check on this machine's kernel ($$here), then $(BLAS_TESTS) and reference-check" \
	  "under OPENBLAS_CORETYPE=$$other"; \
	$(MAKE) --no-print-directory reference-check && \
	OPENBLAS_CORETYPE=$$other $(PYTHON) -m pytest -q -p no:cacheprovider $(BLAS_TESTS) && \
	OPENBLAS_CORETYPE=$$other $(MAKE) --no-print-directory reference-check

plots:
	@test -n "$(RUN)" || { echo "usage: make plots RUN=dir [REF=dir]"; exit 2; }
	$(PYTHON) tools/plots.py $(RUN) $(if $(REF),--ref $(REF))

starters:
	$(PYTHON) tools/make_starters.py

# Students: evolve one file of your own. Copies your file of the stage NN builds on (rubric.json's
# builds_on: NN-1, or 06 for the bonus stages) into stage NN, says so in its first comment, keeps
# the answer-free starter beside it as hw_fsdp.starter.c and lists what stage NN adds. FORCE=1 carries again.
carry:
	@test -n "$(STAGE)" || { echo "usage: make carry STAGE=NN [FORCE=1]"; exit 2; }
	@$(PYTHON) tools/carry.py $(STAGE) $(if $(filter-out 0,$(FORCE)),--force)

# Benchmarks: throughput vs PyTorch, scaling, overlap, memory vs a model, grading time
# (about 5 minutes on 2 cores; results/bench.json and results/bench.md).
bench: all
	$(PYTHON) tools/bench.py
	$(PYTHON) tools/simulate.py --compare --out $(BUILD)/simulate-compare

# Your FSDP on a modelled cluster: a dry run of your stages/NN (SOLUTION=1: the solution) in which every op is
# priced on PROFILE's modelled clock and every allocation counted, nothing executed (tools/simulate.py --help).
# SWEEP="8 16 32 64": one dry run per world size and a plot of tokens/s/GPU and memory against it.
# BATCH, SEQ: the local batch and the sequence. The pipeline stages (11, 12): PP (stages), MICROBATCHES and
# SCHEDULE (1f1b or gpipe), defaults in tools/simulate.py --help; on any other stage they are refused.
STAGE_SIM ?= $(or $(STAGE),04)
comma := ,
space := $(subst ,, )
FLAVOR ?= 8B
WORLD ?= 8
PROFILE ?= h100-sxm
simulate: all
	$(PYTHON) tools/simulate.py --stage $(STAGE_SIM) --flavor $(FLAVOR) --world $(WORLD) --profile $(PROFILE) \
	  $(if $(BATCH),--batch $(BATCH)) $(if $(SEQ),--seq $(SEQ)) $(if $(filter-out 0,$(SOLUTION)),--solutions) \
	  $(if $(PP),--pp $(PP)) $(if $(MICROBATCHES),--microbatches $(MICROBATCHES)) \
	  $(if $(SCHEDULE),--pp-schedule $(SCHEDULE)) \
	  $(if $(SWEEP),--sweep $(subst $(space),$(comma),$(strip $(SWEEP)))) --flags="$(FLAGS)"

# Instructors: every stage's solution against real PyTorch FSDP2 on gloo CPU processes (loss, grad norm,
# DTensors, collectives per phase; logs/fsdp2/). Not in CI. The first run installs torch from the Python
# package index into $(FSDP2_VENV) (CUDA wheels, ~5 GB). STAGE="01 04" picks stages; FSDP2_FLAGS=--main-only
# leaves out the variants (tools/fsdp2_check.py --help).
FSDP2_VENV ?= $(BUILD)/fsdp2-venv
$(FSDP2_VENV)/.fsdp2-ready:
	$(PYTHON) tools/fsdp2_check.py --venv $(FSDP2_VENV) --install-only
fsdp2-check: all $(FSDP2_VENV)/.fsdp2-ready
	$(FSDP2_VENV)/bin/python tools/fsdp2_check.py --venv $(FSDP2_VENV) --no-install $(STAGE) $(FSDP2_FLAGS)

# Instructors: ReduceScatterState vs dev_record_stream on stage 04, published into logs/record_stream/.
record-stream-demo: all
	$(PYTHON) tools/record_stream_demo.py --publish

# The student tree: everything but solutions/ (and the mutants built from them); its starters
# hold no answer. RELEASE=NN writes the staged release holding stages 01..NN only, whose
# starters hold the earlier stages' solutions unless NO_EARLIER_SOLUTIONS=1 (tools/make_handout.py says how).
handout: all
	$(PYTHON) tools/make_handout.py $(if $(RELEASE),--release $(RELEASE)) $(if $(filter-out 0,$(NO_EARLIER_SOLUTIONS)),--no-earlier-solutions)

# Instructors: the Gradescope autograder zip (dist/hwfsdp-gradescope*.zip; INSTRUCTORS.md#gradescope).
# RELEASE=NN: release NN's tree; STAGE=NN: the assignment grades that stage only; VISIBILITY=after_due_date ...
gradescope:
	$(PYTHON) tools/make_gradescope.py $(if $(RELEASE),--release $(RELEASE)) $(foreach s,$(STAGE),--stage $(s)) \
	  $(if $(VISIBILITY),--visibility $(VISIBILITY))

# ---- sanitizers (own build directories; CI runs both) -------------------------------
SAN_BINS = tests/test_runtime tests/test_race tests/test_model tests/test_ops tests/test_io baseline/train \
           $(patsubst %,solutions/%/train,$(SOLUTIONS))
SAN_RUN  = --flavor tiny --seq-len 32 --batch-size 2 --steps 3 --blas-threads 1 --data data/corpus.txt --quiet
tsan:
	$(MAKE) -s BUILD=build-tsan OPT=-O1 EXTRA_CFLAGS=-fsanitize=thread EXTRA_LDFLAGS=-fsanitize=thread \
	  $(addprefix build-tsan/,$(SAN_BINS)) >/dev/null
	@set -e; export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 OPENBLAS_NUM_THREADS=1; \
	for t in test_runtime test_race test_model; do echo "tsan: $$t"; build-tsan/tests/$$t >build-tsan/$$t.log 2>&1 || \
	  { tail -60 build-tsan/$$t.log; echo "tsan: $$t failed (build-tsan/$$t.log)"; exit 1; }; tail -1 build-tsan/$$t.log; done; \
	$(foreach s,$(SOLUTIONS),echo "tsan: $(s)"; build-tsan/solutions/$(s)/train $(SAN_RUN) --world 4 \
	  $(STAGE_FLAGS_$(s)) --link-gbps 5 --out build-tsan/runs/$(s);)
	@echo "tsan: a dry run"; build-tsan/baseline/train $(SAN_RUN) --world 4 --dry-run --out build-tsan/runs/dry-run
	@echo "tsan: clean"
# (gcc 12's -Wformat-truncation misfires on vsnprintf under -fsanitize=undefined)
asan:
	$(MAKE) -s BUILD=build-asan OPT=-O1 EXTRA_CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -Wno-format-truncation" \
	  EXTRA_LDFLAGS="-fsanitize=address,undefined" $(addprefix build-asan/,$(SAN_BINS)) >/dev/null
	@set -e; export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1; \
	for t in test_runtime test_race test_model test_ops test_io; do echo "asan: $$t"; build-asan/tests/$$t >build-asan/$$t.log 2>&1 || \
	  { tail -60 build-asan/$$t.log; echo "asan: $$t failed (build-asan/$$t.log)"; exit 1; }; tail -1 build-asan/$$t.log; done; \
	$(foreach s,$(SOLUTIONS),echo "asan: $(s)"; build-asan/solutions/$(s)/train $(SAN_RUN) --world 3 \
	  $(STAGE_FLAGS_W3_$(s)) --out build-asan/runs/$(s);)
	@echo "asan: a dry run"; ASAN_OPTIONS=detect_leaks=1 build-asan/baseline/train $(SAN_RUN) --world 3 --dry-run \
	  --out build-asan/runs/dry-run
	@echo "asan: clean"

# The whole Python test suite against AddressSanitizer + UBSan binaries.
# (Leak checking stays in `make asan`: OpenMPI's own allocations would drown it here.)
ASAN_FLAGS = OPT=-O1 EXTRA_CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -Wno-format-truncation" \
             EXTRA_LDFLAGS="-fsanitize=address,undefined"
asan-test:
	$(MAKE) -s BUILD=build-asan $(ASAN_FLAGS) SOLUTIONS="$(SOLUTIONS)" all >/dev/null
	HWFSDP_BUILD=build-asan ASAN_OPTIONS=detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	  $(PYTHON) -m pytest -q -p no:cacheprovider tests --deselect tests/test_bench.py

clean:
	rm -rf $(BUILD) build-tsan build-asan
include mk/cuda.mk
include mk/fuzz.mk
