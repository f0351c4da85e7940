/* The AVX2 int8 tile of w8a8.c (q8_tile) timed in L1, one core, against two other layouts: a C program, not part of
 * mtpflow. Build and run: gcc -O3 -march=native avx2_tile.c -o tile && taskset -c 1 ./tile (docs/bench/step_dec07f.md). */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <x86intrin.h>
#define STEPS 144
static signed char W[STEPS*128] __attribute__((aligned(64)));
static unsigned char X[12][STEPS*4] __attribute__((aligned(64)));
static int32_t OUT[12][32];
static inline int32_t load4(const unsigned char *p){int32_t v; memcpy(&v,p,4); return v;}
__attribute__((noinline)) void v0(int mb){ /* current: mb rows of 2 */
  const __m256i ones=_mm256_set1_epi16(1);
  for(int m0=0;m0<mb;m0+=2){
    __m256i acc[2][4]; for(int j=0;j<2;j++)for(int v=0;v<4;v++)acc[j][v]=_mm256_setzero_si256();
    for(int s=0;s<STEPS;s++){ const signed char*ws=W+s*128; __m256i wv[4];
      for(int v=0;v<4;v++)wv[v]=_mm256_loadu_si256((const __m256i*)(ws+32*v));
      for(int j=0;j<2;j++){ const __m256i xb=_mm256_set1_epi32(load4(X[m0+j]+4*s)); const __m256i ax=_mm256_sign_epi8(xb,xb);
        for(int v=0;v<4;v++){ __m256i p=_mm256_maddubs_epi16(ax,_mm256_sign_epi8(wv[v],xb)); acc[j][v]=_mm256_add_epi32(acc[j][v],_mm256_madd_epi16(p,ones));}}}
    for(int j=0;j<2;j++)for(int v=0;v<4;v++)_mm256_storeu_si256((__m256i*)&OUT[m0+j][8*v],acc[j][v]);
  }
}
/* v1: rows 3 at a time, one unit (2 vectors) */
__attribute__((noinline)) void v1(int mb){
  const __m256i ones=_mm256_set1_epi16(1);
  for(int h=0;h<2;h++)
  for(int m0=0;m0<mb;m0+=4){
    __m256i acc[4][2]; for(int j=0;j<4;j++)for(int v=0;v<2;v++)acc[j][v]=_mm256_setzero_si256();
    for(int s=0;s<STEPS;s++){ const signed char*ws=W+s*128+64*h; __m256i wv[2];
      for(int v=0;v<2;v++)wv[v]=_mm256_loadu_si256((const __m256i*)(ws+32*v));
      for(int j=0;j<4;j++){ const __m256i xb=_mm256_set1_epi32(load4(X[m0+j]+4*s)); const __m256i ax=_mm256_sign_epi8(xb,xb);
        for(int v=0;v<2;v++){ __m256i p=_mm256_maddubs_epi16(ax,_mm256_sign_epi8(wv[v],xb)); acc[j][v]=_mm256_add_epi32(acc[j][v],_mm256_madd_epi16(p,ones));}}}
    for(int j=0;j<4;j++)for(int v=0;v<2;v++)_mm256_storeu_si256((__m256i*)&OUT[m0+j][16*h+8*v],acc[j][v]);
  }
}
/* v2: pairs summed in int16 over two steps: only madd once per 2 steps -- NOT exact, for port study */
__attribute__((noinline)) void v2(int mb){
  const __m256i ones=_mm256_set1_epi16(1);
  for(int m0=0;m0<mb;m0+=2){
    __m256i acc[2][4]; for(int j=0;j<2;j++)for(int v=0;v<4;v++)acc[j][v]=_mm256_setzero_si256();
    for(int s=0;s<STEPS;s+=2){ const signed char*ws=W+s*128; 
      for(int j=0;j<2;j++){ const __m256i xb=_mm256_set1_epi32(load4(X[m0+j]+4*s)); const __m256i ax=_mm256_sign_epi8(xb,xb);
        const __m256i xc=_mm256_set1_epi32(load4(X[m0+j]+4*s+4)); const __m256i cx=_mm256_sign_epi8(xc,xc);
        for(int v=0;v<4;v++){ __m256i p=_mm256_maddubs_epi16(ax,_mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(ws+32*v)),xb));
          __m256i q=_mm256_maddubs_epi16(cx,_mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)(ws+128+32*v)),xc));
          acc[j][v]=_mm256_add_epi32(acc[j][v],_mm256_madd_epi16(_mm256_add_epi16(p,q),ones));}}}
    for(int j=0;j<2;j++)for(int v=0;v<4;v++)_mm256_storeu_si256((__m256i*)&OUT[m0+j][8*v],acc[j][v]);
  }
}
int main(){ for(int i=0;i<STEPS*128;i++)W[i]=(i*37)%255-127; for(int j=0;j<12;j++)for(int i=0;i<STEPS*4;i++)X[j][i]=(i*11+j)%255-127;
  void (*f[])(int)={v0,v1,v2}; const char*nm[]={"v0 2-row 4vec","v1 4-row 2vec","v2 int16x2 (inexact)"};
  for(int k=0;k<3;k++) for(int mb=2;mb<=8;mb*=2){ uint64_t best=~0ull; for(int r=0;r<2000;r++){uint64_t t=__rdtsc(); f[k](mb); t=__rdtsc()-t; if(t<best)best=t;}
    double macs=(double)mb*STEPS*128; printf("%-22s mb=%d  %7llu ticks  %.1f MAC/tick  %.2f ticks/row-step\n",nm[k],mb,(unsigned long long)best,macs/best,(double)best/(mb*STEPS)); }
}
