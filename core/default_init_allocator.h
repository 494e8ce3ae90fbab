#ifndef GRADSUM_CORE_DEFAULT_INIT_ALLOCATOR_H_
#define GRADSUM_CORE_DEFAULT_INIT_ALLOCATOR_H_

// An allocator whose value-less construct() default-initialises instead of
// value-initialising, so that resizing a std::vector of a trivial type does not zero the new
// elements. For buffers that are fully overwritten right after they grow (an all-gather's
// output), where the zero fill is a wasted pass over memory.
//
//   std::vector<float, DefaultInitAllocator<float>> buf;
//   buf.resize(n);   // n floats, not zeroed: every element must be written before it is read
//
// Constructions with arguments (push_back, resize(n, value), assign) are unchanged.

#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace gradsum {

template <class T, class A = std::allocator<T>>
class DefaultInitAllocator : public A {
  using Traits = std::allocator_traits<A>;

 public:
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U, typename Traits::template rebind_alloc<U>>;
  };

  using A::A;

  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    Traits::construct(static_cast<A&>(*this), p, std::forward<Args>(args)...);
  }
};

}  // namespace gradsum

#endif  // GRADSUM_CORE_DEFAULT_INIT_ALLOCATOR_H_
