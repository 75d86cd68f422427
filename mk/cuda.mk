# mk/cuda.mk — the CUDA backend (included by the Makefile).
#   make cuda        build everything again against the CUDA runtime into build-cuda/
#                    (kernels for sm_80 and sm_90 and PTX for newer GPUs, warnings are errors; needs nvcc,
#                    cuBLAS and NCCL, never a GPU)
#   make gpu-check   on a machine with a GPU: kernels and collectives vs the CPU ones, each
#                    solution's run vs the CPU run, reruns, sanitizers, the grader; one line
#                    `gpu-check: N passed, N failed` (tools/gpu_check.sh; GPU_CHECK_ARGS="--only 'train-*'")
#   make gpu-calibrate  on a machine with a GPU: the CUDA kernels timed at a dry run's shapes against the modelled
#                    clock's time on PROFILE (default h100-sxm), per op class `gpu-calibrate: <class>
#                    measured/modelled = X.XX (n ops)`, into logs/calibrate/<gpu>-<date>.txt (tools/gpu_calibrate.c;
#                    GPU_CALIBRATE_ARGS="--only matmul --repeats 50"). Compiled only: it has not run on a GPU yet
# The CPU build never needs any of this.

CUDA_BUILD    ?= build-cuda
CUDA_ARCHS    ?= 80 90
# Machine code for each of CUDA_ARCHS, and the PTX of the lowest, which the driver compiles at load
# time for any GPU of that generation or newer (sm_100, sm_120, ...), where machine code alone would
# fail at the first launch with "no kernel image". Older than sm_80 there is no bf16: not supported.
CUDA_PTX_ARCH ?= $(firstword $(CUDA_ARCHS))
NVCC_GENCODE  := $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
                 -gencode arch=compute_$(CUDA_PTX_ARCH),code=compute_$(CUDA_PTX_ARCH)
NVCCFLAGS     := -std=c++17 -O2 -g -Icommon $(NVCC_GENCODE) -Werror all-warnings \
                 -Xcompiler -Wall,-Wextra,-Werror,-Wno-unused-parameter,-Wno-missing-field-initializers
CUDA_CFLAGS   := $(CFLAGS) -I$(CUDA_HOME)/include
CUDA_LDLIBS   := -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart -lnccl -lstdc++ $(LDLIBS)

# The CPU backends (CPU_BACKEND_SRC, the Makefile's) are replaced by common/cuda/ (runtime/backend.h).
CUDA_SHARED_SRC := $(filter-out $(CPU_BACKEND_SRC),$(COMMON_SRC))
CUDA_OBJ := $(patsubst common/%.c,$(CUDA_BUILD)/common/%.o,$(CUDA_SHARED_SRC)) \
            $(patsubst common/cuda/%.c,$(CUDA_BUILD)/common/cuda/%.o,$(wildcard common/cuda/*.c)) \
            $(patsubst common/cuda/%.cu,$(CUDA_BUILD)/common/cuda/%.cu.o,$(wildcard common/cuda/*.cu))
CUDA_LIB := $(CUDA_BUILD)/libhwfsdp_cuda.a
CUDA_HDRS := $(HEADERS)
CUDA_DRIVER_OBJ := $(patsubst common/%.c,$(CUDA_BUILD)/common/%.o,$(DRIVER_SRC))
CUDA_BINS := $(CUDA_BUILD)/baseline/train $(patsubst %,$(CUDA_BUILD)/solutions/%/train,$(SOLUTIONS)) \
             $(patsubst %,$(CUDA_BUILD)/stages/%/train,$(STAGES)) $(CUDA_BUILD)/tests/check_ops \
             $(CUDA_BUILD)/tests/check_colls $(CUDA_BUILD)/tools/gpu_calibrate

.PHONY: cuda cuda-check-tools gpu-check gpu-calibrate impl-cuda

cuda: cuda-check-tools $(CUDA_LIB) $(CUDA_BINS)
	@echo "cuda: built $(words $(CUDA_BINS)) binaries in $(CUDA_BUILD)/ for sm_$(subst $(eval ) ,/sm_,$(CUDA_ARCHS)) (compiled only: run make gpu-check on a GPU machine)"

cuda-check-tools:
	@test -n "$(NVCC)" || { echo "make cuda: nvcc not found (install the CUDA toolkit, or put it on PATH / at /usr/local/cuda)"; exit 2; }
	@test -n "$(HAVE_NCCL)" || { echo "make cuda: nccl.h not found under $(CUDA_HOME)/include or /usr/include (install NCCL)"; exit 2; }

$(CUDA_BUILD)/common/%.o: common/%.c $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CUDA_CFLAGS) -c $< -o $@

$(CUDA_BUILD)/common/cuda/%.cu.o: common/cuda/%.cu $(CUDA_HDRS)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@

$(CUDA_LIB): $(CUDA_OBJ)
	@rm -f $@
	ar rcs $@ $^

# The binaries: the Makefile's link recipes (link_binary; link_impl for an hw_fsdp.c, its object checked for
# state the ranks would share), with the CUDA flags, objects and libraries.
$(CUDA_BUILD)/%: LINK_CFLAGS = $(CUDA_CFLAGS)
$(CUDA_BUILD)/%: LINK_WITH = $(CUDA_DRIVER_OBJ) $(CUDA_LIB)
$(CUDA_BUILD)/%: LINK_LIBS = $(CUDA_LDLIBS)

$(CUDA_BUILD)/baseline/train: common/driver/baseline.c $(CUDA_DRIVER_OBJ) $(CUDA_LIB) tools/check_shared_state.py
	$(call link_impl,$@,$<)

$(CUDA_BUILD)/solutions/%/train: solutions/%/hw_fsdp.c $(CUDA_DRIVER_OBJ) $(CUDA_LIB) tools/check_shared_state.py
	$(call link_impl,$@,$<)

$(CUDA_BUILD)/stages/%/train: LINK_CFLAGS = $(CUDA_CFLAGS) $(STARTER_CFLAGS)
$(CUDA_BUILD)/stages/%/train: stages/%/hw_fsdp.c $(CUDA_DRIVER_OBJ) $(CUDA_LIB) tools/check_shared_state.py
	$(call link_impl,$@,$<)

$(CUDA_BUILD)/tests/check_ops: LINK_CFLAGS = $(CUDA_CFLAGS) -Itests
$(CUDA_BUILD)/tests/check_ops: LINK_WITH = $(CUDA_LIB)
$(CUDA_BUILD)/tests/check_ops: tests/gpu/check_ops.c $(CUDA_LIB)
	$(call link_binary,$@,$<)

$(CUDA_BUILD)/tests/check_colls: LINK_CFLAGS = $(CUDA_CFLAGS) -Itests
$(CUDA_BUILD)/tests/check_colls: LINK_WITH = $(CUDA_LIB)
$(CUDA_BUILD)/tests/check_colls: tests/gpu/check_colls.c $(CUDA_LIB) $(CUDA_HDRS)
	$(call link_binary,$@,$<)

# make gpu-calibrate's program: the CUDA kernels through the runtime's launch path (the CPU build's: the Makefile)
$(CUDA_BUILD)/tools/gpu_calibrate: LINK_WITH = $(CUDA_LIB)
$(CUDA_BUILD)/tools/gpu_calibrate: tools/gpu_calibrate.c $(CUDA_LIB) $(CUDA_HDRS)
	$(call link_binary,$@,$<)

# Any hw_fsdp.c against the CUDA runtime (the grader's --cuda uses it).
impl-cuda: LINK_CFLAGS = $(CUDA_CFLAGS) $(STARTER_CFLAGS)
impl-cuda: LINK_WITH = $(CUDA_DRIVER_OBJ) $(CUDA_LIB)
impl-cuda: LINK_LIBS = $(CUDA_LDLIBS)
impl-cuda: cuda-check-tools $(CUDA_DRIVER_OBJ) $(CUDA_LIB)
	@test -n "$(SRC)" -a -n "$(OUT)" || { echo "usage: make impl-cuda SRC=hw_fsdp.c OUT=binary"; exit 2; }
	$(call link_impl,$(OUT),$(SRC))

gpu-check: all cuda
	bash tools/gpu_check.sh $(GPU_CHECK_ARGS)

gpu-calibrate: cuda
	$(CUDA_BUILD)/tools/gpu_calibrate --profile $(or $(PROFILE),h100-sxm) $(GPU_CALIBRATE_ARGS)
