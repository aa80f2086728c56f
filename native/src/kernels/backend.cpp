#include "gemm.h"
