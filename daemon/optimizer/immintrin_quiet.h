// <immintrin.h>, with GCC 12's false warnings silenced: its AVX-512 headers trip -Wuninitialized on
// their own _mm512_undefined_* (GCC bug 105593, fixed in 13); the warning is attributed to the header,
// so silencing it around the include is enough.
#pragma once

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#ifndef __clang__  // a GCC-only warning
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
