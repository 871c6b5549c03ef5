#ifndef FLCE_SERVER_RANDOM_ID_H_
#define FLCE_SERVER_RANDOM_ID_H_

#include <string>

namespace flce {

// 128 random bits from getrandom(2) as 32 lowercase hex characters: the ids
// of sessions, shared-memory regions and call channels, which name what a
// principal holds and must not be guessable.
std::string RandomId();

}  // namespace flce

#endif  // FLCE_SERVER_RANDOM_ID_H_
