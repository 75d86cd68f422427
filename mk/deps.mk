# mk/deps.mk — the build's Debian packages, checked before anything compiles (included by the Makefile).
# A machine without them gets one line that names what is missing and the apt-get command, instead of a
# compiler error (without OpenBLAS's own <cblas.h>, e.g. with only netlib's, the first error is about `blasint`).
# The top-level make checks for any goal that builds (not clean, carry, plots, gradescope, starters): three tiny
# compiles, once per compiler and flags ($(BUILD)/.deps-ok remembers a pass). NO_DEPS_CHECK=1 skips it.

DEPS_COMMA    := ,
DEPS_EMPTY    :=
DEPS_SPACE    := $(DEPS_EMPTY) $(DEPS_EMPTY)
DEPS_NO_BUILD := clean fuzz-clean carry plots gradescope starters
DEPS_STAMP    := $(BUILD)/.deps-ok
DEPS_KEY      := $(CC) $(CFLAGS) $(LDLIBS)
ifeq ($(MAKELEVEL)$(NO_DEPS_CHECK),0)
ifneq ($(if $(MAKECMDGOALS),$(filter-out $(DEPS_NO_BUILD),$(MAKECMDGOALS)),all),)
ifneq ($(shell cat $(DEPS_STAMP) 2>/dev/null),$(strip $(DEPS_KEY)))
DEPS_PROBE = printf '$(1)\n' | $(CC) $(CFLAGS) -x c - -o /dev/null $(2) >/dev/null 2>&1 && echo 1
DEPS_MISSING := $(strip \
  $(if $(shell command -v $(firstword $(CC)) >/dev/null 2>&1 && echo 1),,gcc) \
  $(if $(shell command -v readelf >/dev/null 2>&1 && echo 1),,binutils) \
  $(if $(shell $(call DEPS_PROBE,#include <stdio.h>\nint main(void) { return puts("") < 0; })),,libc6-dev) \
  $(if $(shell $(call DEPS_PROBE,#include <cblas.h>\nint main(void) { blasint n = 1; float x = 1; return (int)cblas_sdot(n$(DEPS_COMMA) &x$(DEPS_COMMA) 1$(DEPS_COMMA) &x$(DEPS_COMMA) 1) - 1; },-lopenblas)),,libopenblas-dev))
DEPS_WHY_gcc             := the C compiler, $(firstword $(CC))
DEPS_WHY_binutils        := readelf, which checks each hw_fsdp.c for state the rank threads would share
DEPS_WHY_libc6-dev       := the C library's headers
DEPS_WHY_libopenblas-dev := OpenBLAS's <cblas.h> and -lopenblas
ifneq ($(DEPS_MISSING),)
$(error missing Debian packages: $(subst ^, ,$(subst $(DEPS_SPACE),$(DEPS_COMMA)$(DEPS_SPACE),$(foreach p,$(DEPS_MISSING),$(subst $(DEPS_SPACE),^,$(p) ($(DEPS_WHY_$(p))))))); install them with: sudo apt-get install $(DEPS_MISSING) (or run ./hwfsdp all as root, which installs every package the project needs))
endif
$(shell mkdir -p $(BUILD) && printf '%s\n' '$(strip $(DEPS_KEY))' > $(DEPS_STAMP))
endif
endif
endif
