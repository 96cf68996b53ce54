/* Which sources this library was built from: the hash setup.py (or recom_rec/ps/host_lib.py's
 * just-in-time fallback) computes over csrc/ps and its flags (recom_rec/native_build.py), passed as
 * a bare token. A checkout whose sources changed after the build sees another hash and compiles
 * afresh. */
#define RECOM_REC_STR(x) #x
#define RECOM_REC_XSTR(x) RECOM_REC_STR(x)
#ifndef RECOM_REC_SOURCES_SHA256
#define RECOM_REC_SOURCES_SHA256 unknown
#endif

const char *ps_sources_sha256(void) { return RECOM_REC_XSTR(RECOM_REC_SOURCES_SHA256); }
