/*
 * vector_state: checks inside a guest that a process's vector registers
 * survive task switches at page faults. Built by tests/guest_cpu_state.rs
 * (gcc -O2 -static) and run as several processes at once, each with its
 * own tag in every value it loads.
 *
 *   vector_state SECONDS TAG
 *
 * Each round maps 64 fresh anonymous pages and, for each page, loads
 * registers, stores to the page (a page fault: the kernel may switch tasks
 * on the way back), and checks the registers still hold what was loaded:
 * xmm0-7 always, ymm1 where AVX is usable, zmm16 where AVX-512F is. Then
 * glibc's memcpy (which uses the widest usable registers) copies 1 MiB into
 * fresh pages and the copy is compared. Prints one line per kind and exits
 * 1 if any check failed.
 */
#include <cpuid.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define PAGES 64
#define PAGE 4096
#define COPY (1 << 20)

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static uint64_t xgetbv0(void)
{
	uint32_t lo, hi;
	__asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
	return ((uint64_t)hi << 32) | lo;
}

/* AVX (ymm) and AVX-512F (zmm) usable in user mode: CPUID plus XCR0. */
static void usable(int *avx, int *avx512)
{
	unsigned a, b, c, d;
	*avx = *avx512 = 0;
	__cpuid_count(1, 0, a, b, c, d);
	if (!(c & (1u << 27)) || !(c & (1u << 28)))
		return;
	uint64_t xcr0 = xgetbv0();
	*avx = (xcr0 & 0x6) == 0x6;
	__cpuid_count(7, 0, a, b, c, d);
	*avx512 = *avx && (b & (1u << 16)) && (xcr0 & 0xe0) == 0xe0;
}

static void fill(uint64_t *v, int n, int tag, long round, int page)
{
	for (int i = 0; i < n; i++)
		v[i] = ((uint64_t)tag << 56) | ((uint64_t)round << 24) |
		       ((uint64_t)page << 8) | (uint64_t)i;
}

static void xmm_across_fault(const uint64_t *in, uint64_t *out, char *page)
{
	__asm__ volatile("movdqu 0(%1), %%xmm0\n movdqu 16(%1), %%xmm1\n"
			 "movdqu 32(%1), %%xmm2\n movdqu 48(%1), %%xmm3\n"
			 "movdqu 64(%1), %%xmm4\n movdqu 80(%1), %%xmm5\n"
			 "movdqu 96(%1), %%xmm6\n movdqu 112(%1), %%xmm7\n"
			 "movq $1, (%2)\n"
			 "movdqu %%xmm0, 0(%0)\n movdqu %%xmm1, 16(%0)\n"
			 "movdqu %%xmm2, 32(%0)\n movdqu %%xmm3, 48(%0)\n"
			 "movdqu %%xmm4, 64(%0)\n movdqu %%xmm5, 80(%0)\n"
			 "movdqu %%xmm6, 96(%0)\n movdqu %%xmm7, 112(%0)\n"
			 :
			 : "r"(out), "r"(in), "r"(page)
			 : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5",
			   "xmm6", "xmm7", "memory");
}

__attribute__((target("avx"))) static void ymm_across_fault(const uint64_t *in, uint64_t *out,
							     char *page)
{
	__asm__ volatile("vmovdqu (%1), %%ymm1\n movq $1, (%2)\n vmovdqu %%ymm1, (%0)\n vzeroupper\n"
			 :
			 : "r"(out), "r"(in), "r"(page)
			 : "xmm1", "memory");
}

__attribute__((target("avx512f"))) static void zmm_across_fault(const uint64_t *in,
								 uint64_t *out, char *page)
{
	__asm__ volatile("vmovdqu64 (%1), %%zmm16\n movq $1, (%2)\n vmovdqu64 %%zmm16, (%0)\n"
			 :
			 : "r"(out), "r"(in), "r"(page)
			 : "xmm16", "memory");
}

struct kind {
	const char *name;
	int bytes;
	void (*check)(const uint64_t *, uint64_t *, char *);
	long checks, bad;
};

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: vector_state SECONDS TAG\n");
		return 2;
	}
	double seconds = atof(argv[1]);
	int tag = atoi(argv[2]) & 0xff;
	int avx, avx512;
	usable(&avx, &avx512);
	struct kind kinds[] = {
		{ "xmm0-7", 128, xmm_across_fault, 0, 0 },
		{ "ymm1", 32, avx ? ymm_across_fault : NULL, 0, 0 },
		{ "zmm16", 64, avx512 ? zmm_across_fault : NULL, 0, 0 },
	};
	static uint64_t src[COPY / 8];
	long copies = 0, copy_bad = 0, round = 0;
	double t0 = now();
	while (now() - t0 < seconds) {
		for (unsigned k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
			if (!kinds[k].check)
				continue;
			char *buf = mmap(NULL, PAGES * PAGE, PROT_READ | PROT_WRITE,
					 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
			if (buf == MAP_FAILED) {
				perror("mmap");
				return 2;
			}
			for (int p = 0; p < PAGES; p++) {
				uint64_t in[16], out[16];
				fill(in, 16, tag, round, p);
				memset(out, 0, sizeof out);
				kinds[k].check(in, out, buf + (size_t)p * PAGE);
				kinds[k].checks++;
				if (memcmp(in, out, kinds[k].bytes)) {
					kinds[k].bad++;
					fprintf(stderr,
						"vector_state %d: %s changed across a page fault "
						"(round %ld page %d): got %016llx, want %016llx\n",
						tag, kinds[k].name, round, p,
						(unsigned long long)out[kinds[k].bytes / 8 - 1],
						(unsigned long long)in[kinds[k].bytes / 8 - 1]);
				}
			}
			munmap(buf, PAGES * PAGE);
		}
		fill(src, COPY / 8, tag, round, 0);
		char *dst = mmap(NULL, COPY, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
				 -1, 0);
		if (dst == MAP_FAILED) {
			perror("mmap");
			return 2;
		}
		memcpy(dst, src, COPY);
		copies++;
		if (memcmp(dst, src, COPY)) {
			copy_bad++;
			for (size_t i = 0; i < COPY; i++)
				if (dst[i] != ((char *)src)[i]) {
					fprintf(stderr,
						"vector_state %d: memcpy into fresh pages differs "
						"at byte %zu (round %ld)\n",
						tag, i, round);
					break;
				}
		}
		munmap(dst, COPY);
		round++;
	}
	long bad = copy_bad;
	for (unsigned k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
		if (kinds[k].check)
			printf("vector_state %d: %s checks %ld bad %ld\n", tag, kinds[k].name,
			       kinds[k].checks, kinds[k].bad);
		else
			printf("vector_state %d: %s not usable\n", tag, kinds[k].name);
		bad += kinds[k].bad;
	}
	printf("vector_state %d: memcpy copies %ld bad %ld\n", tag, copies, copy_bad);
	return bad ? 1 : 0;
}
