// Binds the extension to glibc symbol versions no newer than 2.28 (Note [Platform floor] in
// platform/compat.h). Included before everything else in every translation unit (setup.py
// passes `-include`), on x86_64 glibc only.
//
// glibc 2.34 moved libpthread, libdl and librt into libc and gave their functions new
// versions (pthread_sigmask moved in 2.32); a build on a new glibc therefore asks for
// GLIBC_2.34 unless told otherwise. Every one of these functions is still exported under its
// old version, which an older glibc provides from libpthread, libdl or librt (setup.py links
// those by name, so they are loaded there). tests/test_platform.py checks the result with
// `objdump -T`.
#pragma once

#if defined(__x86_64__) && defined(__linux__) && !defined(TMX_NO_GLIBC_FLOOR)

#define TMX_OLD_SYMBOL(name, version) __asm__(".symver " #name "," #name "@" #version)

TMX_OLD_SYMBOL(pthread_mutex_trylock, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_mutex_timedlock, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_mutexattr_init, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_mutexattr_destroy, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_mutexattr_setpshared, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_mutexattr_settype, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_mutexattr_setrobust, GLIBC_2.12);
TMX_OLD_SYMBOL(pthread_mutex_consistent, GLIBC_2.12);
TMX_OLD_SYMBOL(pthread_condattr_init, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_condattr_setpshared, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_condattr_setclock, GLIBC_2.3.3);
TMX_OLD_SYMBOL(pthread_condattr_destroy, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_sigmask, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_key_create, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_key_delete, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_getspecific, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_setspecific, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_once, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_atfork, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_create, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_join, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_detach, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_kill, GLIBC_2.2.5);
TMX_OLD_SYMBOL(pthread_setname_np, GLIBC_2.12);
TMX_OLD_SYMBOL(dladdr, GLIBC_2.2.5);
TMX_OLD_SYMBOL(dlsym, GLIBC_2.2.5);
TMX_OLD_SYMBOL(shm_open, GLIBC_2.2.5);
TMX_OLD_SYMBOL(shm_unlink, GLIBC_2.2.5);

#undef TMX_OLD_SYMBOL

#endif
