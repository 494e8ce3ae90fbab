#ifndef GRADSUM_DATA_STREAMS_H_
#define GRADSUM_DATA_STREAMS_H_

// The label streams of a packed document, and the ignore index every label carries where
// there is nothing to predict (SEMANTICS.md §1). Stream 0 is the main one: at document
// position t the input is token t and the label token t + 1. Stream j > 0 is multi-token
// prediction's depth j (§15.1): input t + j, label t + j + 1. Every stream is rolled inside
// its document of the WHOLE packed sequence, so no rank of an SP or CP group needs another
// rank's tokens: past the document's end the input is 0 and the label kIgnoreIndex.
//
//   for (size_t t = 0; t < doc.size(); ++t) {
//     tokens[t] = StreamInput(doc, j, t);
//     labels[t] = StreamLabel(doc, j, t);
//   }
//
// Header only and dependency-free: the model's device ops (model/ops.h) take kIgnoreIndex from
// here too, so the value has one definition.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradsum::data {

// Label of a token that CE ignores (SEMANTICS.md §1).
inline constexpr int32_t kIgnoreIndex = -100;

// Stream j's input at position t of `doc` (t < doc.size()): doc[t + j] inside the document,
// else 0.
inline int32_t StreamInput(const std::vector<int32_t>& doc, int j, size_t t) {
  const size_t u = t + static_cast<size_t>(j);
  return u < doc.size() ? doc[u] : 0;
}

// Stream j's label at position t of `doc`: doc[t + j + 1] inside the document, else
// kIgnoreIndex (the last token of a document has no next token in it).
inline int32_t StreamLabel(const std::vector<int32_t>& doc, int j, size_t t) {
  const size_t u = t + static_cast<size_t>(j) + 1;
  return u < doc.size() ? doc[u] : kIgnoreIndex;
}

// Stream j's valid (labelled) tokens in a document of `length` >= 1 tokens: length - 1 - j,
// at least 0 (n_s of SEMANTICS.md §3 for stream 0, of §15.1's depth j for the others).
inline int64_t StreamValidTokens(int64_t length, int j) {
  return std::max<int64_t>(0, length - 1 - j);
}

}  // namespace gradsum::data

#endif  // GRADSUM_DATA_STREAMS_H_
