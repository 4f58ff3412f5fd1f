/* Which ISA level this library was compiled for: the loader checks it matches what it asked for. */
#include "isa.h"

int kernel_isa(void) { return INFLIGHT_ISA_INDEX; }
