/* The CPU's features from cpuid, as the OS lets them be used (GCC's and clang's
 * __builtin_cpu_supports also check, through xgetbv, that the OS saves the AVX and AVX-512
 * registers). Built with no ISA flags, so it runs on any CPU; kernels/cpu_build.py reads it to
 * choose which variant of the kernels to load. Bit i is feature i of cpu_build.FEATURES. */
int cpu_features(void) {
    int f = 0;
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    __builtin_cpu_init();
    f |= __builtin_cpu_supports("avx") ? 1 << 0 : 0;
    f |= __builtin_cpu_supports("avx2") ? 1 << 1 : 0;
    f |= __builtin_cpu_supports("fma") ? 1 << 2 : 0;
    f |= __builtin_cpu_supports("avx512f") ? 1 << 3 : 0;
    f |= __builtin_cpu_supports("avx512bw") ? 1 << 4 : 0;
    f |= __builtin_cpu_supports("avx512dq") ? 1 << 5 : 0;
    f |= __builtin_cpu_supports("avx512vl") ? 1 << 6 : 0;
    f |= __builtin_cpu_supports("avx512bf16") ? 1 << 7 : 0;
#endif
    return f;
}
