# mk/fuzz.mk — libFuzzer targets for the file readers (included by the Makefile).
#   make fuzz-build                  build-fuzz/fuzz_<target> with clang (-fsanitize=fuzzer,address,undefined)
#   make fuzz [FUZZ_SECONDS=30]      fuzz each target for FUZZ_SECONDS (0: only replay the corpus);
#                                    fails on a crash, a sanitizer report, a leak or a hang, and
#                                    names the crashing inputs under build-fuzz/artifacts/
#   make fuzz NO_FUZZ=1              skip (says so)
#   make fuzz-clean                  remove build-fuzz/ (binaries, working corpora, artifacts)
# Each target runs on a copy of its seed corpus (fuzz/corpus/<target>/ -> build-fuzz/corpus/<target>/),
# so new inputs the fuzzer keeps never land in the repository. See fuzz/README.md.

FUZZ_BUILD   ?= build-fuzz
FUZZ_SECONDS ?= 30
FUZZ_TARGETS := safetensors tokens
FUZZ_CC      ?= $(shell command -v clang 2>/dev/null || command -v clang-14 2>/dev/null)
FUZZ_CFLAGS  := -std=c11 -g -O1 -Wall -Wextra -Werror -Wno-unused-parameter -Wno-missing-field-initializers -D_GNU_SOURCE -Icommon -Ifuzz \
                -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
# fuzz/fuzz_support.h tracks the readers' allocations so that it can free them after a
# fatal() it longjmps out of (and flag a reader that leaks on a successful read).
FUZZ_LDFLAGS := -Wl,--wrap=malloc,--wrap=calloc,--wrap=realloc,--wrap=free -lm
# libFuzzer: inputs up to 8 KiB, 10 s per input is a hang, 2 GiB is a runaway
FUZZ_FLAGS   := -max_len=8192 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1

FUZZ_SRC_safetensors := common/model/safetensors.c common/runtime/json.c common/runtime/util.c
FUZZ_SRC_tokens      := common/model/data.c common/runtime/util.c
FUZZ_BINS := $(patsubst %,$(FUZZ_BUILD)/fuzz_%,$(FUZZ_TARGETS))

.PHONY: fuzz fuzz-build fuzz-check-tools fuzz-clean

fuzz-clean:
	rm -rf $(FUZZ_BUILD)

fuzz-check-tools:
	@test -n "$(FUZZ_CC)" || { echo "make fuzz: clang not found (Debian: apt-get install clang libclang-rt-dev, or ./hwfsdp fuzz; or NO_FUZZ=1 to skip)"; exit 2; }
	@mkdir -p $(FUZZ_BUILD)
	@printf 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { return 0; }\n' > $(FUZZ_BUILD)/probe.c
	@$(FUZZ_CC) -fsanitize=fuzzer,address,undefined $(FUZZ_BUILD)/probe.c -o $(FUZZ_BUILD)/probe >/dev/null 2>&1 || \
	  { echo "make fuzz: $(FUZZ_CC) cannot link libFuzzer with ASan+UBSan (Debian: apt-get install libclang-rt-dev; or NO_FUZZ=1 to skip)"; exit 2; }

ifeq ($(NO_FUZZ),1)
fuzz-build fuzz:
	@echo "fuzz: skipped (NO_FUZZ=1)"
else
fuzz-build: fuzz-check-tools $(FUZZ_BINS)

$(FUZZ_BUILD)/fuzz_%: fuzz/fuzz_%.c fuzz/fuzz_support.h $(wildcard common/*.h common/*/*.h) | fuzz-check-tools
	$(FUZZ_CC) $(FUZZ_CFLAGS) -o $@ $< $(FUZZ_SRC_$*) $(FUZZ_LDFLAGS)
$(foreach t,$(FUZZ_TARGETS),$(eval $(FUZZ_BUILD)/fuzz_$(t): $(FUZZ_SRC_$(t))))

fuzz: fuzz-build
	@set -u; failed=""; touch $(FUZZ_BUILD)/.fuzz-start; \
	for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t $(FUZZ_BUILD)/artifacts/$$t; \
	  cp fuzz/corpus/$$t/* $(FUZZ_BUILD)/corpus/$$t/; \
	  if [ "$(FUZZ_SECONDS)" = 0 ]; then budget="-runs=0"; else budget="-max_total_time=$(FUZZ_SECONDS)"; fi; \
	  dict=""; [ -f fuzz/$$t.dict ] && dict="-dict=fuzz/$$t.dict"; \
	  echo "fuzz: $$t for $(FUZZ_SECONDS) s (corpus $(FUZZ_BUILD)/corpus/$$t, log $(FUZZ_BUILD)/fuzz_$$t.log)"; \
	  if ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
	     $(FUZZ_BUILD)/fuzz_$$t $(FUZZ_FLAGS) $$budget $$dict -artifact_prefix=$(FUZZ_BUILD)/artifacts/$$t/ \
	       $(FUZZ_BUILD)/corpus/$$t > $(FUZZ_BUILD)/fuzz_$$t.log 2>&1; then \
	    grep -E '^(stat::number_of_executed_units|stat::new_units_added)' $(FUZZ_BUILD)/fuzz_$$t.log | \
	      sed 's/^stat::/fuzz:   /'; \
	  else \
	    tail -n 40 $(FUZZ_BUILD)/fuzz_$$t.log; failed="$$failed $$t"; \
	  fi; \
	done; \
	if [ -n "$$failed" ]; then \
	  echo "fuzz: FAILED:$$failed; crashing inputs (rerun one: FUZZ_VERBOSE=1 $(FUZZ_BUILD)/fuzz_<target> FILE):"; \
	  find $(FUZZ_BUILD)/artifacts -type f -newer $(FUZZ_BUILD)/.fuzz-start | sort | sed 's/^/  /'; exit 1; \
	fi; \
	echo "fuzz: no crash in $(words $(FUZZ_TARGETS)) targets"
endif
