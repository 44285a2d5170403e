// Transitional forwarding header: the MoE token dispatchers moved to model/moe/ (issue 36 part 2).
// Still included by model/language_model.h and train/trainer.cpp, which the trainer-components
// branch rewrites in parallel; delete this file once both include model/moe/token_dispatcher.h.
#pragma once
#include "model/moe/token_dispatcher.h"
