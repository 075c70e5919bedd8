import sys

from .run import main, pin_allocator

pin_allocator(sys.argv[1:])
main()
